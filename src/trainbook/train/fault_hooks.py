"""The damage that armed fault points do to a training run (trainbook/faults.py lists them).

Attached by the trainer only when `TRAINBOOK_FAULT` arms them; otherwise nothing here runs.
Detectors (alerts, NaN triage, the hang watchdog) are proven by the real thing these cause in a
real run: a NaN inside a block's forward, a batch of noise, a loop stuck fetching data, memory
that is never released.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch
from torch import nn

from trainbook.data.samples import Batch
from trainbook.faults import fault_active, fault_armed, fault_point
from trainbook.model.moe import Router
from trainbook.phase import PhaseTracker


def attach_block_nan(model: nn.Module, tracker: PhaseTracker, data_step: Callable[[], int]) -> None:
    """Block `TRAINBOOK_FAULT_BLOCK` puts NaN in its output in a training forward (evaluation is
    left alone); a rank without that block does nothing:
    `model.block_nan@N`: every training forward of step N (a re-run of the step too);
    `model.block_nan_once@N`: the first training forward of step N only (a transient fault: the
    step's re-run is clean);
    `data.nan_batch@K`: while training on batch K of the data order (`data_step()`, 1-based; step
    K's batch in a run that skipped no data): a batch that breaks the model, met again by a
    replay of that data, never by a run that skipped it."""
    points = ("model.block_nan", "model.block_nan_once", "data.nan_batch")
    if not any(fault_armed(p) for p in points):
        return
    name = re.compile(rf"(.*\.)?layers\.{int(os.environ.get('TRAINBOOK_FAULT_BLOCK', '0'))}")
    block = next((m for n, m in model.named_modules() if name.fullmatch(n)), None)
    if block is None:
        return
    poisoned: set[int] = set()  # steps whose first forward was poisoned (block_nan_once)

    @torch.compiler.disable  # under train.compile too, an eager hook on the block's output
    def poison(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training:
            return None
        step = tracker.current().step
        once = fault_active("model.block_nan_once", step) and step not in poisoned
        if fault_active("model.block_nan", step) or once or fault_active("data.nan_batch", data_step()):
            poisoned.add(step)
            return output + float("nan")  # (B, T, dim), every element NaN
        return None

    block.register_forward_hook(poison)


def attach_router_collapse(model: nn.Module, tracker: PhaseTracker) -> None:
    """`model.router_collapse@N+`: from step N every MoE router of a training forward sees, in
    place of its tokens, one vector along its expert 0's gate row (logit 10 for expert 0): each
    token chooses expert 0 and the same k - 1 others, the rest of the experts get nothing (a
    collapsed router, for the expert-load alerts)."""
    if not fault_armed("model.router_collapse"):
        return

    @torch.compiler.disable
    def collapse(router: nn.Module, args):
        if not router.training or not fault_active("model.router_collapse", tracker.current().step):
            return None
        (x,) = args
        w0 = router.gate.weight[0].detach().to(x.dtype)
        return (w0 * (10.0 / w0.square().sum()) + torch.zeros_like(x),)  # (N, dim), every row the same

    for module in model.modules():
        if isinstance(module, Router):
            module.register_forward_pre_hook(collapse)


def attach_slow_sync(engine, tracker: PhaseTracker) -> None:
    """`comm.slow_sync@N`: in step N the loss report, the step's last exposed collective, joins
    (TRAINBOOK_FAULT_SLOWDOWN - 1, default 9) times the median of the recent clean steps late on
    this rank: a slow link. The other ranks wait for it inside that collective, so every rank's
    `grad_sync` phase holds the delay (communication-bound, on any machine)."""
    if fault_armed("comm.slow_sync"):
        engine.report_loss = _SlowSync(engine.report_loss, tracker)


class _SlowSync:
    """The engine's `report_loss`, delayed on the steps `comm.slow_sync` names."""

    def __init__(self, report_loss: Callable[[torch.Tensor], torch.Tensor], tracker: PhaseTracker):
        self.report_loss = report_loss
        self.tracker = tracker
        self.clean_steps_s: deque[float] = deque(maxlen=20)  # intervals between clean steps' reports
        self.last: float | None = None  # monotonic time of the previous clean step's report

    def __call__(self, mean: torch.Tensor) -> torch.Tensor:
        step, now = self.tracker.current().step, time.monotonic()
        if fault_active("comm.slow_sync", step):
            if self.clean_steps_s:
                slowdown = float(os.environ.get("TRAINBOOK_FAULT_SLOWDOWN", 10))
                time.sleep((slowdown - 1) * statistics.median(self.clean_steps_s))
            self.last = None  # the next interval holds this delay: not a clean one
        else:
            if self.last is not None:
                self.clean_steps_s.append(now - self.last)
            self.last = now
        return self.report_loss(mean)


def attach_memory_faults(model: nn.Module, tracker: PhaseTracker) -> None:
    """The memory damage of block `TRAINBOOK_FAULT_BLOCK` (default 0), in the training forward:

    `model.block_oom@N`: in step N the block asks the allocator for `TRAINBOOK_FAULT_OOM_BYTES`
    (default 2**50, a PiB) on its device, which no machine has: the allocator's own failure
    (on CPU a RuntimeError "DefaultCPUAllocator: can't allocate memory", on CUDA
    torch.OutOfMemoryError) is raised from inside the block's forward.
    `model.block_leak`: once per step the block keeps a new `TRAINBOOK_FAULT_BYTES` (default
    16 MiB) allocation alive (a leak that grows in the forward phase). A rank without the block
    does nothing."""
    oom, leak = fault_armed("model.block_oom"), fault_armed("model.block_leak")
    if not (oom or leak):
        return
    name = re.compile(rf"(.*\.)?layers\.{int(os.environ.get('TRAINBOOK_FAULT_BLOCK', '0'))}")
    block = next((m for n, m in model.named_modules() if name.fullmatch(n)), None)
    if block is None:
        return
    oom_bytes = int(os.environ.get("TRAINBOOK_FAULT_OOM_BYTES", 1 << 50))
    leak_bytes = int(os.environ.get("TRAINBOOK_FAULT_BYTES", 16 << 20))
    leaked: dict[int, torch.Tensor] = {}  # step -> its allocation, kept for the rest of the run

    @torch.compiler.disable
    def damage(module: nn.Module, args, output: torch.Tensor) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        step = tracker.current().step
        if fault_active("model.block_oom", step):
            torch.empty(oom_bytes, dtype=torch.uint8, device=output.device)
        if fault_active("model.block_leak", step) and step not in leaked:
            # ones, not empty: on CPU only touched pages count in the resident set.
            leaked[step] = torch.ones(leak_bytes // 4, dtype=torch.float32, device=output.device)

    block.register_forward_hook(damage)


class FaultyBatches:
    """Wraps the batch iterator: the fault points of the data path, asked at every batch taken.

    `data.next_batch` (a stop: kill, hang, or wait for the release file) at the first batch of
    each step; `data.slow_batch` delays that batch by (TRAINBOOK_FAULT_SLOWDOWN - 1, default 9)
    times the median duration of the last clean steps, so the step is that many times slower on any machine;
    `data.random_batch` replaces the step's batches with random ids below `vocab_size`;
    `data.skew_mix` replaces every row of a batch that is not from the first source with a row
    of the first source from the same batch (a reader that loses a source and refills);
    `train.leak` keeps an allocation alive per step on `device`; `host.contend` starts, at its
    first step, `TRAINBOOK_FAULT_HOGS` (default 3 per CPU this process may use) processes that
    spin on the CPUs until this process ends (a neighbour's job on the node).
    """

    def __init__(self, batches: Iterator[Batch], tracker: PhaseTracker, vocab_size: int, device: torch.device):
        self.batches = batches
        self.tracker = tracker
        self.vocab_size = vocab_size
        self.device = device
        self.leaked: list[torch.Tensor] = []
        self._last_step = -1
        self._step_started: float | None = None  # monotonic time the previous step took its first batch
        self._clean_steps_s: deque[float] = deque(maxlen=20)  # durations of the last undamaged steps
        self._leak_bytes = int(os.environ.get("TRAINBOOK_FAULT_BYTES", 16 << 20))
        self._hogs: list[subprocess.Popen] = []

    @staticmethod
    def wanted() -> bool:
        return any(fault_armed(p) for p in ("data.next_batch", "data.slow_batch", "data.random_batch",
                                            "data.skew_mix", "train.leak", "host.contend"))

    def __iter__(self) -> FaultyBatches:
        return self

    def __next__(self) -> Batch:
        step = self.tracker.current().step
        if step != self._last_step:  # the first batch of a step
            self._last_step = step
            now = time.monotonic()
            if self._step_started is not None and not fault_active("data.slow_batch", step - 1):
                self._clean_steps_s.append(now - self._step_started)
            self._step_started = now
            fault_point("data.next_batch", step)
            if fault_active("data.slow_batch", step) and self._clean_steps_s:
                slowdown = float(os.environ.get("TRAINBOOK_FAULT_SLOWDOWN", 10))
                time.sleep((slowdown - 1) * statistics.median(self._clean_steps_s))
            if fault_active("host.contend", step) and not self._hogs:
                self._hogs = _start_hogs()
            if fault_active("train.leak", step):
                # ones, not empty: on CPU only touched pages count in the resident set.
                self.leaked.append(torch.ones(self._leak_bytes // 4, dtype=torch.float32, device=self.device))
        batch = next(self.batches)
        if fault_active("data.random_batch", step):
            # Its own generator: the run's RNG streams (dropout, sampling) stay as they were.
            rng = torch.Generator().manual_seed(step)
            noise = torch.randint(0, self.vocab_size, (batch.inputs.shape[0], batch.inputs.shape[1] + 1), generator=rng)
            batch = batch._replace(inputs=noise[:, :-1].contiguous(), targets=noise[:, 1:].contiguous())
        if fault_active("data.skew_mix", step) and batch.sources is not None:
            batch = _skewed(batch)
        return batch


# Spins until its parent, the training process, is gone (however it ends: exit, kill, crash).
_HOG = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent: pass"


def _start_hogs() -> list[subprocess.Popen]:
    n = int(os.environ.get("TRAINBOOK_FAULT_HOGS", 3 * len(os.sched_getaffinity(0))))
    return [subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid())], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def _skewed(batch: Batch) -> Batch:
    """Every row of `batch` from a source other than the first becomes a copy of a first-source row
    of the batch (cycling through them); a batch without one is left as it is."""
    first = torch.nonzero(batch.sources == 0).flatten()  # (K,)
    if len(first) == 0:
        return batch
    rows = torch.arange(len(batch.sources))
    others = torch.nonzero(batch.sources != 0).flatten()
    rows[others] = first[torch.arange(len(others)) % len(first)]
    return Batch(*(None if t is None else t[rows] for t in batch))
