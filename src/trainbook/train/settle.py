"""What a run settles once its processes and its directory exist, before the trainer is built.

The resolution (commands/resolve.py) settles what the config alone decides; these need the
machine and every rank: the device's peak (measured once a host, for MFU), and `train.compile`
and `train.loss` (parallel/compile.py: as an earlier attempt of the run settled them, else on
the slowest rank's peak, so every rank agrees). The trainer is handed the result and never
rewrites its config.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from trainbook.config import Config
from trainbook.model import flops_per_token
from trainbook.monitor.flops import Peak, device_peak
from trainbook.parallel.compile import CompileChoice, settle_compile
from trainbook.parallel.runtime import Runtime


@dataclass(frozen=True)
class Settled:
    cfg: Config
    """The resolved config with train.compile and train.loss as chosen: what this run does."""
    resolved: Config
    """The resolution's config, as checkpoints describe it (a resume compares it with its own)."""
    peak: Peak | None
    peak_note: str
    """What the peak is and where it comes from, or why there is none (logged once)."""
    compiling: CompileChoice
    flops_per_token: float
    accum_steps: int
    """Micro-batches a step on each data-parallel rank."""
    tokens_per_step: int
    """Tokens of one optimizer step over every data-parallel rank."""


def settle(cfg: Config, rt: Runtime, workers: Path) -> Settled:
    """Settle `cfg` on this rank (every rank calls it: a collective). `workers`: the run's
    folder for per-host and per-run records (the measured peak, the compile choice)."""
    dims, t = rt.dims, cfg.train
    token_flops = flops_per_token(cfg.model, t.seq_len)
    peak, note = device_peak(rt.device, cfg.precision.dtype, cache=workers / f"peak-{socket.gethostname()}.json")
    accum = cfg.accum_steps(dims.dp)
    tokens = accum * t.micro_batch_size * cfg.rows_per_sample * t.seq_len * dims.dp
    peaks = [row[0] for row in rt.all_gather_floats([peak.flops if peak else -1.0])]
    compiling = settle_compile(workers / "compile.json", t, rt.device, dims,
                               step_flops=token_flops * tokens / rt.world_size,
                               peak_flops=None if min(peaks) <= 0 else min(peaks),
                               experts=cfg.model.n_experts is not None)
    return Settled(compiling.settled(cfg), cfg, peak, note, compiling, token_flops, accum, tokens)
