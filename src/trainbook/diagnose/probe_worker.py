"""The rank probes of `trainbook check --nproc N`: one process per rank under torchrun.

1. Collectives: all-reduce, all-gather and reduce-scatter once on known values with each result
   checked, then timed, by `parallel/comm_bench.py` (a wrong result is an error naming the op,
   size and rank); the launcher holds the all-reduce bus bandwidth against a floor.
2. Matmul throughput, per rank (`diagnose/preflight.matmul_gflops`). On CPU the ranks share the
   host's cores, so they take turns (each alone between barriers), in `ROUNDS` rounds, the best
   kept; on accelerators, each with its own device, they run at once, as in training.
3. Every rank's figure, host and rank gathered to rank 0, which writes the JSON result.

A rank whose collective fails writes `<json>.rank<R>.err` and exits 1. The fault point
`check.slow_matmul` (TRAINBOOK_FAULT_RANK picks the rank) makes this rank's probe do every
matmul TRAINBOOK_FAULT_SLOWDOWN (default 10) times: really slower, on any machine.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m trainbook.diagnose.probe_worker --json OUT.json [--bytes 4MiB] [--device auto]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from trainbook.diagnose.preflight import matmul_gflops
from trainbook.faults import fault_active, fault_point
from trainbook.parallel.comm_bench import BACKENDS, run_comm_bench
from trainbook.parallel.device import pick_device
from trainbook.parallel.runtime import end_process

ROUNDS = 3


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainbook.diagnose.probe_worker",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="rank 0 writes the result here")
    parser.add_argument("--bytes", type=int, default=4 << 20, help="message size of the collectives")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="collective timeout")
    return parser.parse_args(argv)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # complete or absent


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    device = pick_device(args.device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type != "cpu":  # one accelerator per rank, by its index on this node
        device = torch.device(device.type, local_rank)
        getattr(torch, device.type).set_device(device)
    dist.init_process_group(BACKENDS[device.type], timeout=dt.timedelta(seconds=args.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    rank, n = dist.get_rank(), dist.get_world_size()
    fault_point("check.collectives", 0)  # a rank lost before the collectives (tests)
    try:
        records = run_comm_bench([args.bytes], iters=args.iters, warmup=1, device=device)
    except RuntimeError as e:  # a wrong result here; a peer that left, on the other ranks
        _write(args.json.with_name(f"{args.json.name}.rank{rank}.err"), str(e).splitlines()[0] if str(e) else repr(e))
        end_process_now(1)

    repeat = int(os.environ.get("TRAINBOOK_FAULT_SLOWDOWN", "10")) if fault_active("check.slow_matmul", 0) else 1
    gflops = 0.0
    if device.type == "cpu":  # turns, in rounds: a burst of load elsewhere hits every rank alike
        for _ in range(ROUNDS):
            for turn in range(n):
                if turn == rank:
                    gflops = max(gflops, matmul_gflops(device, reps=3, repeat=repeat))
                dist.barrier()
    else:
        dist.barrier()
        gflops = matmul_gflops(device, repeat=repeat)
    mine = {"rank": rank, "host": socket.gethostname(), "local_rank": local_rank, "gflops": gflops}
    ranks: list[dict] = [{} for _ in range(n)]
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        _write(args.json, json.dumps({"backend": BACKENDS[device.type], "device": device.type, "world_size": n,
                                      "collectives": records, "ranks": ranks}, indent=1))
    end_process(0)


def end_process_now(code: int) -> None:
    """Leave without meeting the other ranks: the collectives that would are what failed."""
    import sys

    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
