"""`trainbook bench model RECIPE`: the recipe's model alone, on synthetic tokens, in this process.

What a step of the model costs without data, checkpoints or monitors: tokens/s, MFU (against the
datasheet peak of a GPU/NPU, or the matmul probe's on a CPU: monitor/flops.py, the probe `check`
runs), where the step's time goes (forward, backward, optimizer, the rest), and peak memory next
to `trainbook plan`'s estimate. The model is built, laid out (activation checkpointing, compile,
the loss) and stepped exactly as `trainbook run` would on one process; `train.compile` and
`train.loss` are settled by the same rule (parallel/compile.py), for the run the recipe describes.
The compile happens in a warm-up pass and is reported apart. Phases are timed with the device
synchronised at each boundary, so they are the device's time, not the host's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trainbook.atomic import atomic_write_json
from trainbook.commands.recipe import recipe_and_overrides
from trainbook.commands.resolve import resolve
from trainbook.config import Config
from trainbook.data.samples import Batch
from trainbook.diagnose.profile import device_sync, phase_boundary
from trainbook.errors import TrainbookError
from trainbook.model import build_model, flops_per_token, num_params
from trainbook.model.surgery import trainable_summary
from trainbook.monitor.flops import TFLOPS, device_peak, mfu
from trainbook.parallel import pick_device
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.compile import decide
from trainbook.parallel.device import peak_memory_bytes
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.plan import memory_estimates
from trainbook.parallel.plan_memory import PlanInputs
from trainbook.parallel.runtime import Runtime
from trainbook.phase import PhaseTracker
from trainbook.precision import Precision
from trainbook.sizes import human
from trainbook.train.build import surgery
from trainbook.train.engine import LocalEngine
from trainbook.train.optim import build_optimizer
from trainbook.train.step import Step

ONE = ParallelDims(1, 1, 1, 1)


@dataclass
class ModelBench:
    model: str
    params: int
    trainable: str
    """What trains: all of it, or what `train.freeze` and `[lora]` leave (model/surgery.py)."""
    device: str
    dtype: str
    tokens_per_step: int
    compile: bool
    loss: str
    choice: str
    """The compile/loss choice and its reason."""
    first_step_s: float
    """The warm-up step: compile (if any) and first-touch costs."""
    step_s: float
    """Median of the timed steps."""
    tokens_per_s: float
    mfu: float | None
    peak_flops: float | None
    peak_source: str
    phases: dict[str, float]
    """Median seconds per phase of the timed steps (forward, backward, optimizer, other)."""
    mem_peak_bytes: int
    plan_bytes: int
    """`trainbook plan`'s per-rank total for this recipe on one rank."""
    steps: int

    @property
    def compile_s(self) -> float:
        return max(0.0, self.first_step_s - self.step_s)


def synthetic_batches(cfg: Config, device_type: str, seed: int = 0):
    """Uniform random token windows of the recipe's shape, forever (documents of 1/4 window
    under `data.packing = document`)."""
    t, m = cfg.train, cfg.model
    gen = torch.Generator().manual_seed(seed)
    positions = None
    if cfg.data.packing == "document":
        positions = (torch.arange(t.seq_len) % max(1, t.seq_len // 4)).expand(t.micro_batch_size, t.seq_len)
    while True:
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
        batch = Batch(tokens[:, :-1], tokens[:, 1:], positions)
        yield Batch(*(None if x is None else x.pin_memory() if device_type == "cuda" else x for x in batch))


def bench_model(cfg: Config, device: torch.device, steps: int = 5) -> ModelBench:
    """Build the model as a one-process run would, take one warm-up step, then `steps` timed ones."""
    t = cfg.train
    accum = t.grad_accum_steps(1)
    tokens_per_step = accum * t.micro_batch_size * t.seq_len
    token_flops = flops_per_token(cfg.model, t.seq_len)
    peak, peak_note = device_peak(device, cfg.precision.dtype)
    choice = decide(t.compile, t.loss, device, ONE, step_flops=token_flops * tokens_per_step,
                    steps=t.max_steps, peak_flops=peak.flops if peak else None,
                    micro_tokens=t.micro_batch_size * t.seq_len)
    torch.manual_seed(cfg.run.seed)
    # Fine-tuning surgery as a run applies it (train.freeze, `[lora]`): frozen weights take no
    # gradient and no optimizer state, so LoRA is measured against full training on one recipe.
    model, _ = surgery(build_model(cfg.model, device, seed=cfg.run.seed), cfg)
    precision = Precision(cfg.precision, device)
    parallelize(model, ONE, None, ApplyOptions(t.activation_checkpoint, choice.compile, loss=choice.loss))
    tracker = PhaseTracker()
    sync = device_sync(device)
    if sync is not None:  # the device's time per phase, not the host's
        tracker.boundary = phase_boundary(lambda *_: sync())
    engine = LocalEngine(model, precision, Runtime(0, 1, ONE, device), tracker)
    optimizer = build_optimizer(model, cfg.optim)
    scaler = precision.loss_scaler()
    batches = synthetic_batches(cfg, device.type, cfg.run.seed)
    train = Step.next_token(engine, optimizer, accum, cfg.optim.grad_clip, scaler, tracker)

    def step() -> tuple[float, dict[str, float]]:
        start = time.perf_counter()
        tracker.begin_step(1)
        result = train(batches)
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - start
        return elapsed, result.phases

    first, _ = step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s, phases = _median_step([step() for _ in range(steps)])
    plan = memory_estimates([(PlanInputs(cfg.model, t, cfg.parallel, cfg.precision.dtype, cfg.lora), ONE)], None)[0]
    return ModelBench(
        model=cfg.model.name or "model", params=num_params(model), trainable=trainable_summary(model), device=str(device), dtype=cfg.precision.dtype,
        tokens_per_step=tokens_per_step, compile=choice.compile, loss=choice.loss, choice=choice.reason,
        first_step_s=first, step_s=step_s, tokens_per_s=tokens_per_step / step_s,
        mfu=mfu(tokens_per_step / step_s, token_flops, peak, 1),
        peak_flops=peak.flops if peak else None, peak_source=peak_note, phases=phases,
        mem_peak_bytes=peak_memory_bytes(device), plan_bytes=plan["largest"]["total"], steps=steps,
    )


def _median_step(timed: list[tuple[float, dict[str, float]]]) -> tuple[float, dict[str, float]]:
    """The median step (the lower of the middle two for an even count): its seconds, and its
    forward, backward, optimizer and everything else, which add up to them (medians taken per
    phase would not, on a busy machine)."""
    step_s, phases = sorted(timed, key=lambda t: t[0])[(len(timed) - 1) // 2]
    split = {k: phases.get(k, 0.0) for k in ("forward", "backward", "optimizer")}
    split["other"] = step_s - sum(split.values())
    return step_s, split


def render(b: ModelBench) -> str:
    split = " | ".join(f"{k} {v:.3g} s ({v / b.step_s:.0%})" for k, v in b.phases.items())
    mfu_text = (f"MFU {b.mfu:.1%} of {b.peak_flops / TFLOPS:.3g} TFLOP/s" if b.mfu is not None
                else "MFU unknown (no peak for this device)")
    first = (f"compile + first step {b.first_step_s:.1f} s (compile ~{b.compile_s:.1f} s, in no figure below)"
             if b.compile else f"first step {b.first_step_s:.2f} s (not counted)")
    return "\n".join([
        f"bench model {b.model}: {b.params:,} parameters, {b.tokens_per_step:,} tokens a step, {b.dtype} on {b.device}",
        f"  {b.trainable}",
        b.choice,
        first,
        f"{b.steps} steps, median {b.step_s:.3g} s: {b.tokens_per_s:,.0f} tokens/s, {mfu_text}",
        f"  {split}",
        f"peak memory {human(b.mem_peak_bytes)} "
        f"({'allocator peak' if b.device.startswith(('cuda', 'npu')) else 'process peak RSS, data and code included'}); "
        f"plan estimates {human(b.plan_bytes)}",
        f"  ({b.peak_source})",
    ])


def bench_model_command(recipe: str | None, overrides: list[str] | None, steps: int,
                        json_out: str | None = None) -> str:
    if steps < 1:
        raise TrainbookError(f"must be at least 1, got {steps}", where="--steps")
    path, overrides = recipe_and_overrides(recipe, overrides)
    res = resolve(path, overrides, world_size=1, local_ranks=1)
    cfg = res.cfg
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    result = bench_model(cfg, pick_device(cfg.run.device), steps)
    if json_out:
        atomic_write_json(Path(json_out), {**asdict(result), "compile_s": result.compile_s})
    return render(result)

