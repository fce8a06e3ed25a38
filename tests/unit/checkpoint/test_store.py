import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainbook.checkpoint import Checkpointer, latest_checkpoint, load_state
from trainbook.config import CheckpointConfig
from trainbook.errors import TrainbookError


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3, 2), value)}, "trainer": {"step": torch.tensor(int(value))}}


def test_save_points_latest_and_round_trips(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep_last=2))
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        path = ckpt.save(step, _state(step))
        assert path == tmp_path / f"step-{step}"
        assert latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-3"]  # keep_last
    restored = _state(0)
    load_state(latest_checkpoint(tmp_path), restored)
    assert torch.equal(restored["model"]["w"], torch.full((3, 2), 3.0))
    assert restored["trainer"]["step"].item() == 3


def test_due():
    every = Checkpointer("x", CheckpointConfig(interval_steps=5))
    assert [s for s in range(1, 13) if every.due(s, 12)] == [5, 10, 12]
    final_only = Checkpointer("x", CheckpointConfig())
    assert [s for s in range(1, 13) if final_only.due(s, 12)] == [12]


def test_a_leftover_temp_dir_is_not_a_checkpoint(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    ckpt.save(1, _state(1))
    (tmp_path / "step-2.tmp").mkdir()  # a crash mid-write
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"
    ckpt.save(2, _state(2))
    assert not (tmp_path / "step-2.tmp").exists()


def test_pickled_objects_are_refused(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"obj": io.BytesIO(b"x"), "w": torch.ones(1)}, checkpoint_id=tmp_path)
    with pytest.raises(TrainbookError, match="refusing to unpickle"):
        load_state(tmp_path, {"obj": io.BytesIO(), "w": torch.zeros(1)})


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(TrainbookError, match="not a trainbook checkpoint"):
        load_state(tmp_path, {})
