"""Collective bandwidth: all-reduce, all-gather and reduce-scatter over message sizes.

Measured on the backend of the current process group (gloo on CPU, NCCL on CUDA, HCCL on Ascend
NPU), and reported as nccl-tests does (its doc/PERFORMANCE.md), so figures compare with theirs:

    algbw = bytes / time       bytes: the full tensor (all-gather's output, reduce-scatter's input)
    busbw = algbw * 2(n-1)/n   all-reduce   (each byte crosses a link twice: reduce, then gather)
    busbw = algbw * (n-1)/n    all-gather, reduce-scatter

busbw is what a ring moves over each link, so it can be held against the link's peak whatever
the rank count. time is the mean over `iters` back-to-back calls after `warmup` calls, between
barriers, and the slowest rank's (all-reduce MAX): a collective is done when its last rank is.

Before timing, every (op, size) runs once on known values (rank r contributes r + 1) and the
result is checked, so a broken collective fails loudly instead of reporting a fast number.

Worker entry point, one process per rank under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m trainbook.parallel.comm_bench [--max-bytes 64MiB] [--iters 20] [--json PATH]
        [--grad-compression]

`--grad-compression` measures DDP's gradient reduction under each `parallel.grad_compression`
instead (parallel/comm_bench_hooks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from trainbook.errors import TrainbookError
from trainbook.parallel.runtime import end_process
from trainbook.sizes import parse_size

OPS = ("all_reduce", "all_gather", "reduce_scatter")
# Bytes that cross each link per byte of the full tensor, on n ranks (nccl-tests' factors).
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KiB, MiB = 1 << 10, 1 << 20


def bus_bandwidth(op: str, algbw: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth for `op` from its algorithm bandwidth (same unit)."""
    return algbw * BUS_FACTOR[op](world_size)


def message_sizes(min_bytes: int = KiB, max_bytes: int = 64 * MiB, factor: int = 4) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes: 1 KiB .. 64 MiB by 4 is 9 sizes."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 0 < min_bytes <= max_bytes and factor >= 2, got "
                         f"{min_bytes}, {max_bytes}, {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def _synchronize(device: torch.device) -> None:
    # NCCL/HCCL calls return once queued on the device stream; gloo's return when done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def _buffers(op: str, numel: int, n: int, dtype: torch.dtype, device: torch.device):
    """(input, output, launch) for one op on a full tensor of `numel` elements."""
    full = torch.empty(numel, dtype=dtype, device=device)
    if op == "all_reduce":
        return full, full, lambda: dist.all_reduce(full)  # in place
    part = torch.empty(numel // n, dtype=dtype, device=device)
    if op == "all_gather":
        return part, full, lambda: dist.all_gather_single(full, part)
    return full, part, lambda: dist.reduce_scatter_single(part, full)


def _check(op: str, inp: torch.Tensor, out: torch.Tensor, launch, rank: int, n: int) -> None:
    """One call on known values: rank r contributes r + 1 everywhere."""
    inp.fill_(rank + 1)
    launch()
    if op == "all_gather":  # row r of the output is rank r's input, exactly
        rows = out.view(n, -1)
        expected = torch.arange(1, n + 1, dtype=torch.float64)
        tolerance = 0.0
    else:  # every element is the sum 1 + 2 + ... + n
        rows = out.view(1, -1)
        expected = torch.tensor([n * (n + 1) / 2], dtype=torch.float64)
        # Exact in fp32 (small integers); bf16/fp16 may round each partial sum of a reduction.
        tolerance = n * torch.finfo(out.dtype).eps
    # Per row, the extremes say it all (and NaN makes them fail): no full-size copies.
    lo, hi = (x.to("cpu", torch.float64) for x in (rows.amin(1), rows.amax(1)))
    error = torch.maximum((lo - expected).abs(), (hi - expected).abs()) / expected
    if not bool((error <= tolerance).all()):
        r = int((error <= tolerance).logical_not().nonzero()[0])
        size = human_bytes(max(inp.numel(), out.numel()) * out.element_size())
        where = f"chunk {r} holds " if op == "all_gather" else ""
        raise RuntimeError(
            f"{op} of {size} {str(out.dtype).removeprefix('torch.')} returned wrong values on "
            f"rank {rank} of {n}: {where}values in [{lo[r].item()}, {hi[r].item()}], "
            f"expected {expected[r].item()}")


def run_comm_bench(
    sizes: Sequence[int],
    iters: int = 20,
    warmup: int = 5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: Sequence[str] = OPS,
) -> list[dict]:
    """Time each op at each size (bytes) in the initialised default process group.

    Every rank must call it with the same arguments. Returns one record per (op, size) for `ops`
    (a subset of OPS), the same on every rank: op, bytes (the size rounded down to whole
    elements per rank), time_us, algbw_GBps and busbw_GBps (GB = 1e9 bytes). RuntimeError if a
    collective returns wrong values.
    """
    device = torch.device(device)
    rank, n = dist.get_rank(), dist.get_world_size()
    element = torch.empty((), dtype=dtype).element_size()
    records = []
    for op in ops:
        for size in sizes:
            # all-gather/reduce-scatter split the full tensor into n equal parts.
            numel = max(size // element // n, 1) * n
            inp, out, launch = _buffers(op, numel, n, dtype, device)
            _check(op, inp, out, launch, rank, n)
            inp.zero_()  # timed calls on zeros: repeated in-place sums never overflow
            for _ in range(warmup):
                launch()
            _synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                launch()
            _synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            seconds = elapsed.item()
            nbytes = numel * element
            algbw = nbytes / seconds / 1e9
            records.append({"op": op, "bytes": nbytes, "time_us": seconds * 1e6,
                            "algbw_GBps": algbw, "busbw_GBps": bus_bandwidth(op, algbw, n)})
            del inp, out, launch
    return records


def format_table(records: list[dict]) -> str:
    """One row per record, grouped by op, in the order given."""
    header = f"{'op':<15}{'size':>10}{'time_us':>12}{'algbw GB/s':>13}{'busbw GB/s':>13}"
    lines = [header, "-" * len(header)]
    for i, r in enumerate(records):
        if i and r["op"] != records[i - 1]["op"]:
            lines.append("")
        lines.append(f"{r['op']:<15}{human_bytes(r['bytes']):>10}{r['time_us']:>12.1f}"
                     f"{r['algbw_GBps']:>13.3g}{r['busbw_GBps']:>13.3g}")
    return "\n".join(lines)


def describe(result: dict) -> str:
    """The line above the table: what was measured, and how."""
    n = result["world_size"]
    what = ("DDP's gradient reduction of one fp32 matrix per rank, per parallel.grad_compression hook"
            if result.get("grad_compression") else f"{result['dtype']}")
    how = "sent = bytes handed to the collectives" if result.get("grad_compression") else "busbw as nccl-tests"
    return (f"{result['backend']} on {result['device']}, {n} rank{'s' if n > 1 else ''}, "
            f"{what}, {result['iters']} iters after {result['warmup']} warmup; "
            f"time = slowest rank's mean; {how}")


def render(result: dict) -> str:
    """The line saying what was measured, then its table (collectives, or compression hooks)."""
    if result.get("grad_compression"):
        from trainbook.parallel.comm_bench_hooks import format_hook_table

        return describe(result) + "\n" + format_hook_table(result["records"])
    return describe(result) + "\n" + format_table(result["records"])


def _size(text: str) -> int:
    try:
        return parse_size(text, where="bytes")
    except TrainbookError as e:
        raise ValueError(str(e)) from None  # argparse reports it as a usage error


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainbook.parallel.comm_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=_size, default=KiB)
    parser.add_argument("--max-bytes", type=_size, default=64 * MiB)
    parser.add_argument("--factor", type=int, default=4, help="ratio of successive sizes")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes the results here")
    parser.add_argument("--grad-compression", action="store_true",
                        help="DDP's gradient reduction under each parallel.grad_compression instead")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """One rank, started by torchrun: init from its environment, bench, report on rank 0."""
    from trainbook.parallel.device import pick_device

    args = _parse_args(argv)
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    device = pick_device(args.device)
    if device.type != "cpu":  # one accelerator per rank, by its index on this node
        device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", 0)))
        getattr(torch, device.type).set_device(device)
    backend = BACKENDS[device.type]
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    if args.grad_compression:
        from trainbook.parallel.comm_bench_hooks import run_hook_bench

        records, dtype = run_hook_bench(sizes, args.iters, args.warmup, device), "float32"
    else:
        records, dtype = run_comm_bench(sizes, args.iters, args.warmup, DTYPES[args.dtype], device), args.dtype
    if dist.get_rank() == 0:
        result = {"backend": backend, "device": device.type, "world_size": dist.get_world_size(),
                  "dtype": dtype, "iters": args.iters, "warmup": args.warmup,
                  "grad_compression": args.grad_compression, "records": records}
        print(render(result))
        if args.json is not None:
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(args.json)  # complete or absent
    end_process(0)


if __name__ == "__main__":
    main()
