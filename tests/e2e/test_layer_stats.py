"""Per-layer statistics of a real run, checked against what the run's own checkpoints say.

With a checkpoint after every step, the weights before step k are checkpoint k-1's: each block's
`param_norm` and `update_ratio` at step k are recomputed from the checkpoint files alone; the
block gradient norms compose to the step's reported (pre-clip) `grad_norm`; and measuring changes
nothing: the losses are bitwise those of a run without statistics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from trainbook.checkpoint import load_state, tensor_entries
from trainbook.diagnose.layers import block_of

STEPS = ["train.max_steps=4", "log.every_steps=1", "checkpoint.interval_steps=1", "checkpoint.keep_last=10"]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    shapes = {k.removeprefix("model."): tuple(v.size) for k, v in tensor_entries(ckpt).items()
              if k.startswith("model.")}
    model = {name: torch.empty(shape) for name, shape in shapes.items()}
    load_state(ckpt, {"model": model})
    return model


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


@pytest.mark.slow
def test_layer_statistics_match_the_checkpoints_and_change_nothing(recipe, tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    for run_dir, every in ((on, 1), (off, 0)):
        done = run_cli("run", str(recipe), *STEPS, f"monitor.layer_stats_every={every}", "--run-dir", str(run_dir),
                       cwd=recipe.parent)
        assert done.returncode == 0, done.stderr
    assert _losses(on) == _losses(off)  # bitwise: the hooks only read
    assert not (off / "layers.jsonl").exists()

    layers = {r["step"]: r for r in map(json.loads, (on / "layers.jsonl").read_text().splitlines())}
    grad_norms = {r["step"]: r["grad_norm"] for r in map(json.loads, (on / "metrics.jsonl").read_text().splitlines())
                  if r["kind"] == "train"}
    assert sorted(layers) == [1, 2, 3, 4]
    for step in (2, 3, 4):
        before, after = _weights(on / "checkpoints" / f"step-{step - 1}"), _weights(on / "checkpoints" / f"step-{step}")
        blocks = layers[step]["blocks"]
        by_block: dict[str, list[float]] = {}
        for name, w in before.items():
            if name == "output.weight" and "output" not in blocks:  # tied to the embedding
                continue
            acc = by_block.setdefault(block_of(name), [0.0, 0.0])
            acc[0] += w.double().square().sum().item()
            acc[1] += (after[name].double() - w.double()).square().sum().item()
        assert by_block.keys() == blocks.keys()
        for block, (param_sq, update_sq) in by_block.items():
            assert blocks[block]["param_norm"] == pytest.approx(math.sqrt(param_sq), rel=1e-6), (step, block)
            assert blocks[block]["update_ratio"] == pytest.approx(math.sqrt(update_sq / param_sq), rel=1e-5), (step, block)
        total = math.sqrt(sum(b["grad_norm"] ** 2 for b in blocks.values()))
        assert total == pytest.approx(grad_norms[step], rel=1e-5)
        groups = layers[step]["groups"]
        assert math.sqrt(sum(g["grad_norm"] ** 2 for g in groups.values())) == pytest.approx(total, rel=1e-9)
        for block, stats in blocks.items():
            if block.startswith("layers."):
                assert stats["act_std"] > 0 and stats["act_max_abs"] >= abs(stats["act_mean"])
                assert 0 <= stats["act_zero_frac"] < 1
