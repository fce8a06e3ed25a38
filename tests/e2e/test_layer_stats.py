"""Per-layer statistics of a real run, checked against what the run's own checkpoints say.

With a checkpoint after every step, the weights before step k are checkpoint k-1's: each block's
`param_norm` and `update_ratio` at step k are recomputed from the checkpoint files alone; the
block gradient norms compose to the step's reported (pre-clip) `grad_norm`; and measuring changes
nothing: the losses are bitwise those of a run without statistics. Under `train.compile` the
activation statistics are the eager run's, and measuring neither changes the compiled run nor
compiles anything more.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import prepared_recipe, run_cli
from trainbook.checkpoint import load_state, tensor_entries
from trainbook.diagnose.blocks import block_of

STEPS = ["train.max_steps=4", "log.every_steps=1", "checkpoint.interval_steps=1", "checkpoint.keep_last=10"]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    shapes = {k.removeprefix("model."): tuple(v.size) for k, v in tensor_entries(ckpt).items()
              if k.startswith("model.")}
    model = {name: torch.empty(shape) for name, shape in shapes.items()}
    load_state(ckpt, {"model": model})
    return model


def _rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _rows(run_dir, "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.slow
def test_layer_statistics_match_the_checkpoints_and_change_nothing(compiled_runs, tmp_path):
    """The eager run below (statistics every step, a checkpoint after each) against the same run
    without statistics."""
    on, off = compiled_runs["eager"][0], tmp_path / "off"
    recipe = on.parent / "unit.toml"
    done = run_cli("run", str(recipe), *STEPS, "train.compile=false", "monitor.layer_stats_every=0",
                   "--run-dir", str(off), cwd=recipe.parent)
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


ACTS = ("act_mean", "act_std", "act_max_abs", "act_zero_frac")
# Every frame dynamo traces (TORCH_LOGS=dynamo): its function and file:line.
_TRACED = re.compile(r"torchdynamo start tracing (\S+) (\S+)")


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory, debug_data) -> dict[str, tuple[Path, list[tuple[str, str]]]]:
    """Four steps (evaluations at 0, 3 and 4): eager with statistics every step and a checkpoint
    after each (the test above reads it too), compiled with statistics every 2nd (armed on steps 2
    and 4, off on 1 and 3), and compiled without statistics. Each run's directory and the frames
    dynamo traced. Compiling takes 20-30 s a run on a 2-core CPU, so the runs are shared."""
    root = tmp_path_factory.mktemp("compiled")
    recipe = prepared_recipe(root, debug_data)
    runs = {}
    for name, compiled, every, extra in (("eager", "false", 1, STEPS), ("compiled", "true", 2, []),
                                         ("compiled_off", "true", 0, [])):
        run_dir = root / name
        done = run_cli("run", str(recipe), "train.max_steps=4", "log.every_steps=1", *extra,
                       f"train.compile={compiled}", f"monitor.layer_stats_every={every}", "--run-dir", str(run_dir),
                       cwd=root, env={"TORCH_LOGS": "dynamo"})
        assert done.returncode == 0, done.stderr
        runs[name] = run_dir, _TRACED.findall(done.stderr)
    return runs


@pytest.mark.slow
def test_compiled_activation_statistics_are_the_eager_ones(compiled_runs):
    """Block outputs of compiled blocks differ from eager ones by inductor's float32 reordering:
    statistics within 1e-5 relative, 1e-7 absolute (measured: 5e-7 relative at most, act_mean)."""
    (eager, _), (compiled, _) = compiled_runs["eager"], compiled_runs["compiled"]
    want, got = ({r["step"]: r["blocks"] for r in _rows(d, "layers.jsonl")} for d in (eager, compiled))
    assert sorted(got) == [2, 4] and sorted(want) == [1, 2, 3, 4]
    for step, blocks in ((step, want[step]) for step in got):
        for block in ("layers.0", "layers.1"):
            expected = {k: blocks[block][k] for k in ACTS}
            assert {k: got[step][block][k] for k in ACTS} == pytest.approx(expected, rel=1e-5, abs=1e-7), (step, block)


@pytest.mark.slow
def test_compiled_statistics_change_nothing_and_compile_nothing(compiled_runs):
    """With statistics on, the compiled run is bitwise the one without (losses, gradient norms,
    validation losses, final weights), and dynamo traced the same frames: the blocks' forward for
    training and for evaluation and the loss's chunk, no hook, whichever steps were armed."""
    (on, traced_on), (off, traced_off) = compiled_runs["compiled"], compiled_runs["compiled_off"]
    keep = ("kind", "step", "loss", "grad_norm", "val_loss")
    assert [{k: r[k] for k in keep if k in r} for r in _rows(on, "metrics.jsonl")] == \
        [{k: r[k] for k in keep if k in r} for r in _rows(off, "metrics.jsonl")]
    w_on, w_off = (_weights(d / "checkpoints" / "step-4") for d in (on, off))
    assert w_on.keys() == w_off.keys()
    for name in w_on:
        assert torch.equal(w_on[name], w_off[name]), name
    assert traced_on == traced_off
    # The block for training, the chunked loss's kernels (train.loss = auto: chunked when compiled;
    # evaluation's computes the loss alone), the block for evaluation: all before step 1
    # (`compiled` in events.jsonl), none after.
    assert sorted(f for f, _ in traced_on) == ["_chunk_loss_and_grad", "_chunk_loss_only", "forward", "forward"], \
        traced_on
    for run in (on, off):
        compiled = [e for e in _rows(run, "events.jsonl") if e["kind"] == "compiled"]
        assert len(compiled) == 1 and compiled[0]["step"] == 0 and compiled[0]["seconds"] > 0
