"""`train.compile` and `train.loss`: whether a run compiles its blocks and its loss, and why.

`compile = "auto"` (the default) compiles where it pays:
- never where it cannot run: a device inductor does not generate code for (an NPU without its own
  compiler backend), a CPU with no C++ compiler, a GPU without triton;
- not under tensor parallel (compiled blocks of DTensor shards fail in backward on torch 2.13) or
  pipeline parallel (not measured faster here); `compile = true` forces it on regardless;
- only when the run is long enough to repay compiling twice over: compiling takes `COMPILE_S`
  seconds, and saves `STEP_GAIN` of each step's time. The step time is estimated from below, as
  the step's FLOPs at the device's peak (monitor/flops.py), and the saving must be at least
  `MARGIN` times the compile, so a run that may not repay it stays eager, and a CPU peak probe
  slowed by a busy neighbour (which makes steps look longer) does not flip the choice: the
  900-step run of the 1.8M-parameter default recipe on 2 CPU cores stays eager (~14 s saved
  against the 60 s needed) unless its probe reads 4x too slow; a 100-step run of a
  7M-parameter 2K-context model compiles (~80 s).

`loss = "auto"` computes the loss chunked (model/loss.py: the head and cross entropy together, at
most 2048 rows of logits at once) when the blocks are compiled, or when a micro-batch holds more
rows than one chunk; from full logits otherwise. Measured on 2 CPU cores (benchmarks/loss.py),
eager: 16,384 tokens x vocab 2048, chunked 1.22x faster than full; 2,048 tokens x vocab 1024 (the
default recipe's micro-batch: one chunk), chunked 0.71x, so a single chunk stays full. Tensor parallel keeps full logits
(its head's output is a vocabulary-sharded DTensor), and so does a pipeline whose stages are
FSDP-sharded (the head's weight is gathered only inside the stage's forward, and the pipeline's
loss runs after it).

The choice is made once per run, on the slowest rank's peak so every rank agrees, and logged once
with its reason; the run directory keeps it (`workers/compile.json`) so that a resumed attempt
compiles exactly when the first did (numerics differ by inductor's float32 reordering).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trainbook.atomic import atomic_write_json
from trainbook.model.loss import DEFAULT_CHUNK_TOKENS
from trainbook.parallel.dims import ParallelDims

COMPILE_S = {"cpu": 30.0, "cuda": 60.0}
"""A first compile of the blocks and the loss, cold cache: ~30 s measured on 2 CPU cores for the
tiny recipe (`trainbook bench model` prints it as "compile ~N s"); on a GPU not measured here,
taken as twice that until benchmarks/accelerator.sh measures it."""
MARGIN = 2.0
"""What compiling must save, in multiples of what it costs."""
STEP_GAIN = 0.10
"""Fraction of step time compiling saves, measured on 2 CPU cores: the debug shape (dim 256, 6
layers, 2K context) compiled blocks with the chunked loss against eager, interleaved in one
process, 1.10x; the tiny recipe, separate runs, 1.04x (blocks alone) to 1.13x (with the loss)."""


@dataclass(frozen=True)
class CompileChoice:
    compile: bool
    loss: str
    """`chunked` or `full`."""
    reason: str
    """Why, in one line: what is logged once per run."""

    def settled(self, cfg):
        """`cfg` (a Config) with train.compile and train.loss as chosen."""
        return cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": self.compile, "loss": self.loss})})


def settle_compile(record: Path, train, device: torch.device, dims: ParallelDims, *, step_flops: float,
                   peak_flops: float | None, experts: bool = False) -> CompileChoice:
    """`decide` for a run whose directory keeps the choice in `record`: an earlier attempt's
    choice for the same settings is reused (a resumed run compiles exactly when the first did)."""
    settings = [train.compile, train.loss]
    try:
        kept = json.loads(record.read_text())
        if kept.pop("settings") == settings:
            return CompileChoice(**kept)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    choice = decide(train.compile, train.loss, device, dims, step_flops=step_flops, steps=train.max_steps,
                    peak_flops=peak_flops, micro_tokens=train.micro_batch_size * train.seq_len, experts=experts)
    record.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record, {"settings": settings, **asdict(choice)})
    return choice


def compiler_missing(device: torch.device) -> str | None:
    """Why torch.compile's inductor cannot generate code for `device` here, or None."""
    if device.type == "cpu":
        if os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "clang++", "c++")):
            return None
        return "no C++ compiler (g++, clang++ or $CXX) for inductor's CPU code"
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "triton is not installed"
    return f"inductor has no code generator for {device.type} devices in this torch"


def decide(setting: bool | str, loss: str, device: torch.device, dims: ParallelDims, *,
           step_flops: float, steps: int, peak_flops: float | None, micro_tokens: int = 0,
           experts: bool = False) -> CompileChoice:
    """`setting`: train.compile (True, False or "auto"); `loss`: train.loss; `step_flops`: one
    rank's FLOPs per optimizer step; `steps`: the run's planned length (train.max_steps);
    `peak_flops`: one device's peak, None when unknown; `micro_tokens`: tokens per micro-batch;
    `experts`: the model is a mixture of experts (eager for now: resolution refuses `true`)."""
    if setting == "auto" and experts:
        on, why = False, "a mixture of experts trains eager for now"
    elif setting == "auto":
        on, why = _auto(device, dims, step_flops, steps, peak_flops)
    else:
        on, why = bool(setting), f"train.compile = {str(setting).lower()}"
    chunked, loss_why = _loss(loss, on, dims, micro_tokens)
    return CompileChoice(on, "chunked" if chunked else "full",
                         f"compile {'on' if on else 'off'} ({why}); loss {'chunked' if chunked else 'full'} ({loss_why})")


def _auto(device: torch.device, dims: ParallelDims, step_flops: float, steps: int,
          peak_flops: float | None) -> tuple[bool, str]:
    missing = compiler_missing(device)
    if missing:
        return False, missing
    if dims.tp > 1:
        return False, "compiled blocks under tensor parallel fail in backward on this torch"
    if dims.pp > 1:
        return False, "compile under pipeline parallel is not measured faster here"
    if peak_flops is None:
        return False, "no peak FLOP/s for this device, so no estimate of what compiling saves"
    saved = steps * step_flops / peak_flops * STEP_GAIN
    cost = COMPILE_S.get(device.type, COMPILE_S["cuda"])
    if saved < MARGIN * cost:
        return False, (f"{steps} steps would save ~{saved:.0f} s at most, less than twice the ~{cost:.0f} s "
                       "compiling takes")
    return True, f"{steps} steps save at least ~{saved:.0f} s against ~{cost:.0f} s compiling"


def _loss(setting: str, compiled: bool, dims: ParallelDims, micro_tokens: int) -> tuple[bool, str]:
    if setting == "full":
        return False, "train.loss = full"
    if dims.tp > 1:
        return False, "tensor parallel keeps vocabulary-sharded full logits"
    if dims.pp > 1 and dims.dp > 1:
        return False, "a pipeline's loss runs outside its FSDP-sharded last stage"
    if setting == "chunked":
        return True, "train.loss = chunked"
    if compiled:
        return True, "compiled, the chunked loss is faster and never holds the full logits"
    if micro_tokens > DEFAULT_CHUNK_TOKENS:
        return True, (f"{micro_tokens} tokens a micro-batch: {micro_tokens // DEFAULT_CHUNK_TOKENS}+ chunks of "
                      f"{DEFAULT_CHUNK_TOKENS}, faster than full logits")
    return False, f"eager, and {micro_tokens} tokens a micro-batch fit one chunk: full logits are faster"
