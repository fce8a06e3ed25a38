import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainbook.checkpoint import (
    Checkpointer, InvalidCheckpoint, latest_checkpoint, load_state, locate, newest_valid, read_latest, verify,
)
from trainbook.config import CheckpointConfig
from trainbook.errors import TrainbookError


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((300, 200), value)}, "trainer": {"step": torch.tensor(int(value))}}


def _save_steps(root, steps, **cfg) -> Checkpointer:
    ckpt = Checkpointer(root, CheckpointConfig(**cfg))
    for step in steps:
        ckpt.save(step, _state(step))
    ckpt.close()
    return ckpt


def _names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_save_commits_a_verified_manifest_and_round_trips(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(), describe={"config_sha256": "abc"})
    assert latest_checkpoint(tmp_path) is None
    path = ckpt.save(3, _state(3), info={"tokens": 96})
    ckpt.close()
    assert path == tmp_path / "step-3" and read_latest(tmp_path) == 3
    assert latest_checkpoint(tmp_path) == path
    manifest = verify(path)
    assert manifest["step"] == 3 and manifest["tokens"] == 96 and manifest["config_sha256"] == "abc"
    on_disk = {p.name: p.stat().st_size for p in path.iterdir() if p.name != "manifest.json"}
    assert {name: entry["size"] for name, entry in manifest["files"].items()} == on_disk
    restored = _state(0)
    load_state(path, restored)
    assert torch.equal(restored["model"]["w"], torch.full((300, 200), 3.0))
    assert restored["trainer"]["step"].item() == 3


def test_keep_last_and_keep_every(tmp_path):
    _save_steps(tmp_path, range(1, 11), keep_last=2, keep_every=4)
    assert _names(tmp_path) == ["latest", "step-10", "step-4", "step-8", "step-9"]
    assert read_latest(tmp_path) == 10


def test_due_by_steps_and_by_time():
    every = Checkpointer("x", CheckpointConfig(interval_steps=5))
    assert [s for s in range(1, 13) if every.due(s, 12)] == [5, 10, 12]
    final_only = Checkpointer("x", CheckpointConfig())
    assert [s for s in range(1, 13) if final_only.due(s, 12)] == [12]
    timed = Checkpointer("x", CheckpointConfig(interval_minutes=0.002))  # 0.12 s
    assert not timed.due(1, 100)
    time.sleep(0.15)
    assert timed.due(2, 100)


def test_async_save_stages_a_copy_and_commits_in_the_background(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(mode="async"))
    state = _state(1)
    ckpt.save(1, state)
    ckpt.wait_staged()  # what the trainer does before its next optimizer step
    state["model"]["w"].fill_(-5.0)  # training goes on and changes the weights
    assert ckpt.wait() == tmp_path / "step-1"
    ckpt.save(2, _state(2))
    ckpt.close()  # awaits the save in flight
    assert read_latest(tmp_path) == 2
    restored = _state(0)
    load_state(tmp_path / "step-1", restored)
    assert torch.equal(restored["model"]["w"], torch.full((300, 200), 1.0))


def _skips(root):
    skipped = []
    found = newest_valid(root, on_skip=lambda path, why: skipped.append((path.name, why)))
    return (found[0].name if found else None), skipped


def _shard(path):
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


def test_corrupted_checkpoints_are_skipped_for_the_newest_valid_one(tmp_path):
    _save_steps(tmp_path, [1, 2, 3])
    shard = _shard(tmp_path / "step-3")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    meta = tmp_path / "step-2" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01
    meta.write_bytes(bytes(data))
    found, skipped = _skips(tmp_path)
    assert found == "step-1"
    assert skipped[0][0] == "step-3" and "bytes, the manifest says" in skipped[0][1]
    assert skipped[1][0] == "step-2" and "fails its checksum" in skipped[1][1]


def test_a_manifest_naming_paths_outside_is_rejected(tmp_path):
    _save_steps(tmp_path, [1])
    manifest_path = tmp_path / "step-1" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    (tmp_path / "secret").write_bytes(b"x")
    manifest["files"]["../secret"] = {"size": 1, "crc32": "8cdc1683"}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(InvalidCheckpoint, match="outside the checkpoint"):
        verify(tmp_path / "step-1")
    with pytest.raises(TrainbookError, match="outside the checkpoint"):
        locate(tmp_path / "step-1")


def test_uncommitted_and_temporary_dirs_are_never_chosen(tmp_path):
    _save_steps(tmp_path, [1, 2])
    (tmp_path / "latest").write_text("step-1\n")  # as if the crash came before `latest` moved
    (tmp_path / "step-3.tmp").mkdir()
    assert _skips(tmp_path) == ("step-1", [])
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    ckpt.discard_uncommitted(resumed_step=1)
    ckpt.close()
    assert _names(tmp_path) == ["latest", "step-1"]


CRASHING_SAVE = textwrap.dedent("""
    import sys, torch
    from trainbook.checkpoint import Checkpointer
    from trainbook.config import CheckpointConfig
    ckpt = Checkpointer(sys.argv[1], CheckpointConfig(mode=sys.argv[2]))
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((1000,), float(step))})
    ckpt.close()
""")


@pytest.mark.parametrize("point", ["writing", "before_manifest", "before_rename", "before_latest"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_kill_during_save_leaves_the_previous_checkpoint_selected(tmp_path, point, mode):
    env = {**os.environ, "TRAINBOOK_FAULT": f"checkpoint.{point}@2"}
    done = subprocess.run([sys.executable, "-c", CRASHING_SAVE, str(tmp_path), mode], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert read_latest(tmp_path) == 1
    assert _skips(tmp_path) == ("step-1", [])
    restored = {"w": torch.zeros(1000)}
    load_state(tmp_path / "step-1", restored)
    assert torch.equal(restored["w"], torch.ones(1000))


def test_pickled_objects_are_refused(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"obj": io.BytesIO(b"x"), "w": torch.ones(1)}, checkpoint_id=tmp_path)
    with pytest.raises(TrainbookError, match="refusing to unpickle"):
        load_state(tmp_path, {"obj": io.BytesIO(), "w": torch.zeros(1)})


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path):
    _save_steps(tmp_path, [1])
    with pytest.raises(TrainbookError, match=r"model.w: checkpoint has shape \(300, 200\), this run has \(3, 2\)"):
        load_state(tmp_path / "step-1", {"model": {"w": torch.zeros(3, 2)}})


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(TrainbookError, match="not a trainbook checkpoint"):
        load_state(tmp_path, {})
    with pytest.raises(TrainbookError, match="neither a run directory nor a checkpoint"):
        locate(tmp_path)


def test_a_rollback_removes_the_newer_checkpoints_and_points_latest_back(tmp_path):
    _save_steps(tmp_path, [2, 4, 6, 8], keep_last=10)
    assert newest_valid(tmp_path, lambda *_: None, at_most=7)[0] == tmp_path / "step-6"
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep_last=10))
    assert ckpt.roll_back_to(4) == [6, 8]
    ckpt.close()
    assert _names(tmp_path) == ["latest", "step-2", "step-4"] and read_latest(tmp_path) == 4
    assert newest_valid(tmp_path, lambda *_: None)[0] == tmp_path / "step-4"
