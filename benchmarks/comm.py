"""Collective bus bandwidth: all-reduce, all-gather and reduce-scatter over message sizes.

Starts `--nproc` local ranks with `python -m torch.distributed.run --standalone` on the backend
`run.device = auto` picks (gloo on CPU, NCCL on CUDA, HCCL on Ascend NPU). For each op and size
(min..max bytes by powers of 4): one checked call on known values, `--warmup` untimed calls, then
`--iters` calls between barriers; time is the slowest rank's mean per call. algbw = bytes / time
(bytes: all-gather's output, reduce-scatter's input, all-reduce's buffer) and busbw as nccl-tests
defines it: algbw x 2(n-1)/n for all-reduce, x (n-1)/n for the other two. GB = 1e9 bytes.
The same code backs `trainbook bench comm` (trainbook.parallel.comm_bench).

    .venv/bin/python benchmarks/comm.py [--nproc 2] [--min-bytes 1KiB] [--max-bytes 64MiB]
        [--iters 20] [--warmup 5] [--dtype float32|bfloat16|float16] [--device auto|cpu|cuda|npu]
"""

from __future__ import annotations

import argparse

from trainbook.commands.bench import bench_comm_command
from trainbook.parallel.comm_bench import DTYPES
from trainbook.sizes import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    parser.add_argument("--min-bytes", type=lambda t: parse_size(t, where="--min-bytes"), default="1KiB")
    parser.add_argument("--max-bytes", type=lambda t: parse_size(t, where="--max-bytes"), default="64MiB")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per op and size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    args = parser.parse_args()
    print(bench_comm_command(args.nproc, args.max_bytes, args.iters, min_bytes=args.min_bytes,
                             warmup=args.warmup, dtype=args.dtype, device=args.device), flush=True)


if __name__ == "__main__":
    main()
