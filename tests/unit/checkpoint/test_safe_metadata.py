"""`.metadata` is read by an allow-list unpickler: real metadata loads, a hostile pickle runs nothing."""

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainbook.checkpoint import Checkpointer, load_state, tensor_entries
from trainbook.checkpoint.metadata import read_metadata
from trainbook.config import CheckpointConfig
from trainbook.errors import TrainbookError


def _checkpoint(root, mode: str = "sync"):
    """A committed trainbook checkpoint of tensors of several dtypes (what a run's state holds)."""
    state = {"model": {"w": torch.randn(30, 20), "b": torch.zeros(20, dtype=torch.bfloat16)},
             "rng": {"rank0": {"torch_cpu": torch.get_rng_state(), "python_gauss": torch.tensor(0.5, dtype=torch.float64)}},
             "trainer": {"step": torch.tensor(3)}}
    ckpt = Checkpointer(root, CheckpointConfig(mode=mode))
    ckpt.save(3, state)
    ckpt.close()
    return root / "step-3", state


class _Touch:
    """Unpickling this creates a file: what an attacker's `.metadata` would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_real_metadata_loads_equal_to_what_dcp_reads(tmp_path, mode):
    path, state = _checkpoint(tmp_path, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = dcp.FileSystemReader(path).read_metadata()
    safe = read_metadata(path / ".metadata")
    assert safe.state_dict_metadata == plain.state_dict_metadata
    assert safe.storage_data == plain.storage_data
    assert safe.planner_data == plain.planner_data
    loaded = {k: {n: torch.empty_like(t) for n, t in v.items()} if k != "rng" else
              {"rank0": {n: torch.empty_like(t) for n, t in v["rank0"].items()}} for k, v in state.items()}
    load_state(path, loaded)  # DCP's own load path, through the safe reader
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])


def test_a_hostile_metadata_is_refused_and_runs_nothing(tmp_path):
    path, state = _checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    for opens in (lambda: tensor_entries(path), lambda: load_state(path, {"model": dict(state["model"])}),
                  lambda: read_metadata(path / ".metadata")):
        with pytest.raises(TrainbookError) as e:
            opens()
        assert str(e.value).startswith(f"{path / '.metadata'}: ") and "io.open" in str(e.value)
        assert "\n" not in str(e.value)
    assert not marker.exists()


def test_an_allowed_class_holding_a_hostile_object_is_refused(tmp_path):
    # The outer object is allowed; what it holds is not: the allow-list applies at every depth.
    path, _ = _checkpoint(tmp_path)
    metadata = read_metadata(path / ".metadata")
    marker = tmp_path / "pwned"
    metadata.planner_data = {"x": _Touch(marker)}
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(TrainbookError, match="io.open"):
        tensor_entries(path)
    assert not marker.exists() and not os.path.exists(str(marker))
