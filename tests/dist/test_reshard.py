"""A checkpoint written by one process loads into 2 FSDP2 ranks, and theirs back into one process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from trainbook.checkpoint import Checkpointer, load_state, newest_valid, tensor_entries, verify
from trainbook.config import CheckpointConfig, ModelConfig
from trainbook.model import build_model, resolve
from trainbook.train.optim import optimizer_state, optimizer_state_like

WORKER = Path(__file__).with_name("reshard_worker.py")


def _trained_state() -> dict:
    """A debug model after two AdamW steps: moments that differ from any fresh init."""
    model = build_model(resolve(ModelConfig(name="debug", vocab_size=96)), "cpu", seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(tokens).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"model": model.state_dict(), "optim": optimizer_state(model, optimizer),
            "trainer": {"step": torch.tensor(10)}}


def test_one_process_to_two_fsdp_ranks_and_back(tmp_path):
    original = _trained_state()
    saver = Checkpointer(tmp_path / "one", CheckpointConfig())
    saver.save(10, original)
    saver.close()

    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(WORKER), str(tmp_path / "one" / "step-10"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    deadline = time.monotonic() + 30
    while not (out / "latest").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)

    for step in (11, 12):  # sync and async saves from two ranks: one manifest lists both ranks' files
        manifest = verify(out / f"step-{step}")
        assert manifest["world_size"] == 2
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["files"])
    assert newest_valid(out, on_skip=lambda *a: None)[0].name == "step-12"

    model = build_model(resolve(ModelConfig(name="debug", vocab_size=96)), "cpu", seed=99)
    entries = tensor_entries(out / "step-12")
    restored = {"model": model.state_dict(), "optim": optimizer_state_like(model, entries)}
    load_state(out / "step-12", restored)
    for name, tensor in original["model"].items():
        assert torch.equal(restored["model"][name], tensor), name
    for name, moments in original["optim"].items():
        for key, value in moments.items():
            assert torch.equal(restored["optim"][name][key], value), (name, key)
