"""Compressed gradient reduction, measured: DDP's communication hooks as `parallel.grad_compression`
runs them (parallel/compression.py), on one gradient bucket holding a square fp32 matrix of each
size, per rank (`trainbook bench comm --grad-compression`).

For each size and hook: the bytes a rank hands to the collectives per reduction (counted at the
process group, as in training), the time per reduction (the slowest rank's mean over `iters` after
`warmup`, between barriers), the gradient reduced per second (the fp32 bucket's bytes / time) and
the speed-up over the uncompressed all-reduce of the same bucket. PowerSGD compresses from its first
call here (rank `rank`, error feedback and warm start on); a matrix too small to gain twice goes
whole, as in training.

Before timing, every hook reduces a known bucket once (rank r holds r + 1 everywhere: a rank-1
matrix that every hook, PowerSGD included, must return as the mean (n + 1) / 2), so a broken hook
fails loudly instead of reporting a fast number.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainbook.parallel.compression import CompressionSpec, CountingGroup, DDPCompression
from trainbook.parallel.plan_memory import human

HOOKS = ("none", "bf16", "fp16", "powersgd")


class MatrixBucket:
    """What DDP's hooks read of a bucket (`dist.GradBucket`'s methods): one matrix's gradient."""

    def __init__(self, grad: torch.Tensor):
        self.shape = grad.shape
        self._buffer = grad.reshape(-1)

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer.view(self.shape)]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _side(size: int) -> int:
    """The side of the largest square fp32 matrix of at most `size` bytes."""
    return max(math.isqrt(size // 4), 1)


def _check(hook: DDPCompression, side: int, rank: int, n: int, device: torch.device) -> None:
    known = torch.full((side, side), float(rank + 1), device=device)
    out = hook.hook(None, MatrixBucket(known)).wait().float()
    expected = (n + 1) / 2
    error = (out - expected).abs().max().item() / expected
    if not error <= 1e-3:  # NaN fails too
        raise RuntimeError(f"{hook.spec.mode} reduction of a {side}x{side} gradient returned wrong values on "
                           f"rank {rank} of {n}: off by {error:.2g} of the mean {expected}")


def run_hook_bench(sizes: Sequence[int], iters: int = 20, warmup: int = 5, device: torch.device | str = "cpu",
                   rank: int = 4, hooks: Sequence[str] = HOOKS) -> list[dict]:
    """Time each hook at each size (bytes of the fp32 gradient) in the initialised default group;
    every rank calls it with the same arguments. One record per (size, hook): hook, bytes (the
    bucket's, fp32), sent (per rank and reduction), time_us, grad_GBps, speedup (vs `none` of the
    same size, when `none` is among `hooks`)."""
    device = torch.device(device)
    me, n = dist.get_rank(), dist.get_world_size()
    group = CountingGroup(dist.group.WORLD)
    records = []
    for size in sizes:
        side = _side(size)
        grad = torch.zeros(side, side, device=device)
        base = None
        for mode in hooks:
            spec = CompressionSpec(mode, rank, start_sync=0)
            _check(DDPCompression(spec, group), side, me, n, device)
            hook = DDPCompression(spec, group)
            for _ in range(warmup):
                hook.hook(None, MatrixBucket(grad.clone())).wait()
            dist.barrier()
            group.take()
            start = time.perf_counter()
            for _ in range(iters):
                hook.hook(None, MatrixBucket(grad.clone())).wait()
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
            sent = group.take() // iters
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            seconds = elapsed.item()
            base = seconds if mode == "none" else base
            records.append({"hook": mode, "bytes": grad.numel() * 4, "sent": sent, "time_us": seconds * 1e6,
                            "grad_GBps": grad.numel() * 4 / seconds / 1e9,
                            "speedup": base / seconds if base is not None else None})
    return records


def format_hook_table(records: list[dict]) -> str:
    """One row per record, grouped by size."""
    header = (f"{'hook':<10}{'gradient':>10}{'sent/rank':>12}{'x fewer':>9}{'time_us':>12}"
              f"{'grad GB/s':>11}{'speed-up':>10}")
    lines = [header, "-" * len(header)]
    full = {}
    for i, r in enumerate(records):
        if i and r["bytes"] != records[i - 1]["bytes"]:
            lines.append("")
        full.setdefault(r["bytes"], r["sent"] if r["hook"] == "none" else r["bytes"])
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(f"{r['hook']:<10}{human(r['bytes']):>10}{human(r['sent']):>12}"
                     f"{full[r['bytes']] / r['sent']:>8.1f}x{r['time_us']:>12.1f}{r['grad_GBps']:>11.3g}{speedup:>10}")
    return "\n".join(lines)
