"""Every parallel layout computes what one process computes: the real CLI under torchrun, gloo.

The `tiny` model (tied embeddings, grouped-query attention; vocabulary cut to 512) trains 20 steps
in fp32 with the same global batch (256 tokens: 8 samples of 32) in every layout, micro-batches of
2 samples, so the layouts change only how the same 8 samples per step are spread over ranks,
accumulation steps and pipeline chunks. Each layout is compared with the single-process run of the
same recipe on three things:

- the loss of every train step and evaluation (metrics.jsonl);
- the gradient norm of every step, measured before clipping: a gradient off by a constant factor
  (summed instead of averaged over ranks) changes no loss that clipping and AdamW normalise, but
  it changes this number;
- the final weights: every model tensor of the step-20 checkpoint, read back whole whatever the
  layout (DCP reshards on load), compared by max |a - b| / max |b| per tensor.

Per-layer statistics (layers.jsonl, every step) are global whatever the layout: block and
parameter-group norms of sharded (FSDP, TP) parameters, activation statistics summed over
data-parallel ranks, pipeline stages merged. Step 1 runs on identical weights in every layout, so
its statistics are held to 1e-5; later steps to the weights' bound.

Two layouts compute the loss chunked (`train.loss = chunked`, model/loss.py: the head inside the
loss, 2048 rows of logits at a time) against the single-process full loss: FSDP (the head's
weight gathered inside the root's forward) and a 1F1B pipeline (its last stage returns hidden
states and the pipeline's loss function applies the head).

One data-parallel layout (fsdp2) trains with `optim.grad_clip = 0` against a single-process run
without clipping too, so the update itself follows the raw gradient there.

Two layouts train a tiny Qwen3 with q/k/v biases (`qwen3-tiny`: q/k norms, head_dim 32 over dim
128, 8 heads / 2 kv heads) against the single-process run of the same model: tensor parallel
(biases split with their projections' rows; the q/k norms' gains replicated, their gradient
summed over each rank's heads) and FSDP. A q_norm gain whose gradient is left unsummed over tp
moves that gain by ~4e-3 relative in 20 steps and the gradient norm by ~2e-4.

Three layouts split each sequence over 2 context-parallel ranks (`cp2`, `cp2-tp2` with tensor
parallel inside each, `cp2-pp2` with 2 pipeline stages, each stage deriving its share's global
positions): every attention gathers the other rank's keys and values and masks by global
position; the one-process step-10 checkpoint also resumes at cp = 2. A stage that took its share
as positions 0..T/cp-1 (cp2-pp2) is off by 1.4e-2 in the loss and 1.4e-1 in the weights.

Tolerances. Every layout adds the same per-sample gradients in another order (all-reduce,
reduce-scatter, sharded matmuls, pipeline chunks of 1 sample accumulated); AdamW's 1/sqrt(v)
magnifies such rounding in near-zero gradients, most in the weights. Largest differences measured
here over all layouts (pipelines against the ordinary single-process run): loss 1.7e-7, gradient
norm 1.2e-6, weights 9.0e-5 (cp2-tp2; tp2, fsdp2-tp2 7.5e-5; cp2 4.7e-5; cp2-pp2 4.3e-5; pipelines 2.5e-5;
qwen3-tp2 4.8e-5, qwen3-fsdp2 5.5e-6). The bounds below keep a margin
over those and stay far below what a wrong gradient produces (a summed instead of averaged
gradient doubles the gradient norm; a skipped tied-gradient exchange moves the embedding by
~1e-2 relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import DebugData, run_cli, write_recipe
from trainbook.checkpoint import load_state, tensor_entries

COMMON = ["model.name=tiny", "train.max_steps=20", "train.micro_batch_size=2", "train.eval_every=10",
          "log.every_steps=1", "checkpoint.interval_steps=10", "monitor.layer_stats_every=1"]
NO_CLIP = "optim.grad_clip=0"
# A tiny Qwen3 (q/k norms, head_dim 32 != dim / n_heads = 16, 8 heads / 2 kv heads) with Qwen2.5's
# q/k/v biases too: every option of the decoder that tensor parallel places.
QWEN3 = ["model.name=qwen3-tiny", "model.qkv_bias=true"]

LAYOUTS = {
    "ddp2": (2, ["parallel.data_parallel=ddp", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "fsdp2-chunked-loss": (2, ["parallel.dp_shard=2", NO_CLIP, "train.loss=chunked"]),
    "tp2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "pp2-gpipe": (2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=gpipe"]),
    "pp2-1f1b-chunked-loss": (2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=1f1b",
                                  "train.loss=chunked"]),
    "hsdp2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "fsdp2-tp2": (4, ["parallel.dp_shard=2", "parallel.tp=2"]),
    "fsdp2-pp2": (4, ["parallel.dp_shard=2", "parallel.pp=2"]),
    "qwen3-tp2": (2, QWEN3 + ["parallel.tp=2", "parallel.dp_shard=1"]),
    "qwen3-fsdp2": (2, QWEN3 + ["parallel.dp_shard=2"]),
    # Context parallel: each sequence split over 2 ranks (head-tail), keys and values gathered.
    "cp2": (2, ["parallel.cp=2", "parallel.dp_shard=1"]),
    "cp2-tp2": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.dp_shard=1"]),
    "cp2-pp2": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.dp_shard=1"]),
}

# Largest relative difference allowed: (loss, grad_norm, weights); see the module docstring.
REL = (1e-5, 1e-5, 5e-4)


def _metrics(run_dir: Path) -> dict[tuple[str, int], float]:
    """{("train", step): loss, ("grad_norm", step): norm, ("eval", step): val_loss}"""
    values = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "train":
            values["train", r["step"]] = r["loss"]
            values["grad_norm", r["step"]] = r["grad_norm"]
        elif r["kind"] == "eval":
            values["eval", r["step"]] = r["val_loss"]
    return values


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model tensors of the step-20 checkpoint, whole, whatever layout wrote them."""
    ckpt = run_dir / "checkpoints" / "step-20"
    shapes = {k.removeprefix("model."): tuple(v.size) for k, v in tensor_entries(ckpt).items()
              if k.startswith("model.")}
    model = {name: torch.empty(shape) for name, shape in shapes.items()}
    load_state(ckpt, {"model": model})
    return model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _differences(got: tuple[dict, dict], expected: tuple[dict, dict]) -> dict[str, tuple[float, str]]:
    """The largest relative difference of each kind (loss, grad_norm, weights) and where it is."""
    (metrics, weights), (metrics_ref, weights_ref) = got, expected
    assert metrics.keys() == metrics_ref.keys()
    assert weights.keys() == weights_ref.keys()
    worst = dict.fromkeys(("loss", "grad_norm", "weights"), (0.0, ""))
    for key, ref in metrics_ref.items():
        kind = "grad_norm" if key[0] == "grad_norm" else "loss"
        worst[kind] = max(worst[kind], (abs(metrics[key] - ref) / abs(ref), f"{key}: {metrics[key]} vs {ref}"))
    for name, ref in weights_ref.items():
        worst["weights"] = max(worst["weights"], (_relative(weights[name], ref), name))
    return worst


def _layers(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "layers.jsonl").read_text().splitlines())}


def _layer_differences(got: dict[int, dict], expected: dict[int, dict]) -> dict[int, tuple[float, str]]:
    """Per step, the largest relative difference of any layer statistic and where it is. A mean
    is held relative to its block's spread (it may be ~0), a zero fraction absolutely."""
    assert got.keys() == expected.keys()
    worst = {}
    for step, ref in expected.items():
        worst[step] = (0.0, "")
        for part in ("blocks", "groups"):
            assert got[step][part].keys() == ref[part].keys(), (step, part)
            for name, stats in ref[part].items():
                assert got[step][part][name].keys() == stats.keys(), (step, name)
                for key, b in stats.items():
                    a = got[step][part][name][key]
                    scale = {"act_mean": max(abs(b), stats.get("act_std", 0.0)), "act_zero_frac": 1.0}.get(key, abs(b))
                    diff = abs(a - b) / scale if scale > 0 else abs(a - b)
                    worst[step] = max(worst[step], (diff, f"{part} {name} {key}: {a} vs {b}"))
    return worst


class Baselines:
    """Single-process runs of the recipe, made once each and shared: one per model (a layout's
    `model.*` overrides) and clipping (with or without) that some layout asks for."""

    def __init__(self, tmp: Path, data: DebugData):
        self.recipe = write_recipe(tmp / "unit.toml", data.corpus, cache_dir=data.cache)
        self._runs: dict[tuple, tuple[dict, dict]] = {}

    def run_dir(self, clip: bool = True, model: tuple[str, ...] = ()) -> Path:
        name = "single" + ("" if clip else "-noclip") + "".join(f"-{o.replace('=', '_')}" for o in model)
        return self.recipe.parent / name

    def results(self, clip: bool = True, model: tuple[str, ...] = ()) -> tuple[dict, dict]:
        key, run_dir = (clip, model), self.run_dir(clip, model)
        if key not in self._runs:
            done = run_cli("run", str(self.recipe), *COMMON, *model, *([] if clip else [NO_CLIP]),
                           "--run-dir", str(run_dir), cwd=self.recipe.parent)
            assert done.returncode == 0, done.stderr
            self._runs[key] = _metrics(run_dir), _weights(run_dir)
            assert len([k for k in self._runs[key][0] if k[0] == "train"]) == 20
        return self._runs[key]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, debug_data):
    return Baselines(tmp_path_factory.mktemp("layouts"), debug_data)


def _run(baselines: Baselines, nproc: int, overrides: list[str], run_dir: Path, *extra: str):
    done = run_cli("run", str(baselines.recipe), *COMMON, *overrides, "--nproc", str(nproc), *extra,
                   "--run-dir", str(run_dir), cwd=baselines.recipe.parent, timeout=600)
    # Exit 0, nothing tolerated: a finished run's ranks meet and end without gloo's teardown
    # (parallel/runtime.py, Runtime.finish).
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "done: 20 steps" in done.stdout
    return done


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_process(baselines, tmp_path, layout):
    nproc, overrides = LAYOUTS[layout]
    # The single-process run of the same model, clipped as the layout is.
    baseline = {"clip": NO_CLIP not in overrides, "model": tuple(o for o in overrides if o.startswith("model."))}
    expected = baselines.results(**baseline)
    _run(baselines, nproc, overrides, tmp_path / layout)
    worst = _differences((_metrics(tmp_path / layout), _weights(tmp_path / layout)), expected)
    tolerance = dict(zip(worst, REL))
    print(layout, {kind: f"{value:.2e}" for kind, (value, _) in worst.items()})
    failed = {kind: (f"{value:.3e} > {tolerance[kind]:.0e}", where) for kind, (value, where) in worst.items()
              if not value <= tolerance[kind]}
    assert not failed, (layout, failed)
    layers = _layer_differences(_layers(tmp_path / layout), _layers(baselines.run_dir(**baseline)))
    assert len(layers) == 20
    print(layout, "layers", f"step 1 {layers[1][0]:.2e}", f"worst {max(layers.values())[0]:.2e}")
    assert layers[1][0] <= 1e-5, (layout, layers[1])
    assert max(layers.values())[0] <= REL[2], (layout, max(layers.values()))
    env = json.loads((tmp_path / layout / "env.json").read_text())
    assert env["world_size"] == nproc
    # Every rank reported its step time, data wait and peak memory; rank 0 wrote the spread.
    for line in (tmp_path / layout / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            for spread in record["ranks"].values():
                assert 0 <= spread["min_rank"] < nproc and 0 <= spread["max_rank"] < nproc
                assert 0 <= spread["min"] <= spread["max"]


RESUMED_LAYOUTS = {  # resharding: (processes, overrides)
    "fsdp2-tp2": LAYOUTS["fsdp2-tp2"],
    # The tied head's copy on the last stage takes the embedding's optimizer state.
    "pp2-1f1b": (2, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=1f1b"]),
    "cp2": LAYOUTS["cp2"],
}


@pytest.mark.parametrize("layout", RESUMED_LAYOUTS)
def test_a_one_process_checkpoint_resumes_in_another_layout(baselines, tmp_path, layout):
    """Step 10 of the single-process run continues in `layout`; steps 11-20 match the
    uninterrupted single-process run."""
    nproc, overrides = RESUMED_LAYOUTS[layout]
    expected, _ = baselines.results()
    checkpoint = baselines.run_dir() / "checkpoints" / "step-10"
    _run(baselines, nproc, overrides, tmp_path / "resumed", "--resume", str(checkpoint))
    got = _metrics(tmp_path / "resumed")
    assert sorted(k for k in got if k[0] == "train") == [("train", s) for s in range(11, 21)]
    rel = REL[0]
    for key, value in got.items():
        if key[0] != "grad_norm":
            assert value == pytest.approx(expected[key], rel=rel), (key, value, expected[key])
