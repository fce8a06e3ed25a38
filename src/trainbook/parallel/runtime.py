"""The process group of one run: started from torchrun's environment, one backend per device kind.

One process (no torchrun, WORLD_SIZE unset or 1) starts no process group at all: every collective
helper here is then a no-op, and training is exactly the single-device loop.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from trainbook.errors import TrainbookError
from trainbook.parallel.dims import ParallelDims

AGENT_STORE_ENV = "TRAINBOOK_AGENT_STORE"  # HOST:PORT of the elastic agent's rendezvous store
GROUP_ENV = "TRAINBOOK_GROUP"  # this process group's name (start_runtime)

# gloo on CPU, NCCL on CUDA, HCCL on Ascend (registered by torch_npu; see parallel/npu.py).
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LISTEN_PORTS = (20000, 32767)
"""Where `free_port` looks when the kernel's ephemeral range cannot be read (Linux's default range
starts at 32768)."""


def free_port(host: str = "localhost", tries: int = 64) -> int:
    """A port free now, from outside the kernel's ephemeral range, for a server another process
    binds later (the c10d rendezvous endpoint the launcher hands to torchrun).

    The usual "bind port 0, read it, close" hands out an ephemeral port, and the kernel hands the
    same range to every outgoing connection: in the seconds before the server binds it (a torch
    import, a rendezvous), one of the machine's connections, gloo's included, may take it
    (EADDRINUSE). Outside that range only another explicit bind can, and a random pick makes that
    rare. Falls back to an ephemeral port when no other range is left.
    """
    try:
        low, high = (int(x) for x in Path(EPHEMERAL_RANGE).read_text().split())
        lo, hi = (10000, low - 1) if low > 11000 else (high + 1, 65535)
    except (OSError, ValueError):
        lo, hi = LISTEN_PORTS
    pick = random.SystemRandom()  # not the global generator a caller may have seeded
    for port in (pick.randint(lo, hi) for _ in range(tries if hi - lo >= 1000 else 0)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


T = TypeVar("T")


def env_world_size() -> int:
    """The world size torchrun set for this process (1 when started directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Runtime:
    """Where this process sits: rank, layout, mesh (None in one process), device."""

    rank: int
    world_size: int
    dims: ParallelDims
    device: torch.device
    mesh: Any = None
    finished: bool = False
    """Every rank has finished the run (`finish`): the process group is left to the process exit."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.dims.coordinate(self.rank)["pp"]

    def all_reduce_mean(self, value: torch.Tensor, over: int) -> torch.Tensor:
        """Sum over all ranks divided by `over` (ranks holding a copy of the same quantity)."""
        if not self.distributed:
            return value
        value = value.detach().clone()
        dist.all_reduce(value)
        return value / over

    def all_gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (same length on all ranks), indexed by rank."""
        if not self.distributed:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=torch.float64, device=self.device)
        dist.all_gather_single(out, mine)  # all_gather_into_tensor is deprecated in 2.13
        return out.view(self.world_size, len(values)).tolist()

    def all_gather_objects(self, value: T) -> list[T]:
        """Every rank's `value` (a small picklable object: a host name), indexed by rank."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def rank0_first(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0, share its result (or its user error) with every rank.

        For work that must happen once (creating the run directory, preparing data into a
        shared cache): the other ranks never race rank 0, and a bad input fails on all ranks
        with the same one-line error instead of leaving them waiting.
        """
        if not self.distributed:
            return fn()
        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn())
            except TrainbookError as e:
                box[0] = ("error", e.message, e.where)
        dist.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            raise TrainbookError(box[0][1], where=box[0][2])
        return box[0][1]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def finish(self) -> None:
        """This rank's run is over: meet every rank, then leave the process group to the exit.

        A worker ends with `os._exit` (cli.main): no destructors, the kernel closes its sockets.
        The barrier makes that safe: until every rank has got here, a peer may still be in its
        last collective (or a checkpoint thread's) and would see this rank's connections close
        under it. After it nobody communicates any more, and the group is not torn down:
        destroy_process_group() would run gloo's shutdown of its pairs and threads while peers
        are already exiting, the one piece of C++ teardown left once os._exit skips the
        interpreter's (where DESIGN.md's "terminate called without an active exception" came
        from), and of no use to a process that ends now.
        """
        if self.distributed and dist.is_initialized():
            dist.barrier()
            self.finished = True

    def close(self) -> None:
        """After a failure: tear the process group down (a peer may never reach a barrier)."""
        if self.distributed and dist.is_initialized() and not self.finished:
            dist.destroy_process_group()


def end_process(code: int = 0) -> NoReturn:
    """A worker whose every collective is done: meet the other ranks, then end without teardown.

    For entry points that hold a process group outside `Runtime` (the collective benchmark, test
    workers); the reasoning is `Runtime.finish`'s.
    """
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def start_runtime(dims: ParallelDims, device: torch.device, timeout_s: float,
                  flight_recorder: bool = False) -> Runtime:
    """Join torchrun's process group (if any) and build the device mesh; `flight_recorder` turns
    on c10d's record of collectives (parallel/flight.py) for the hang watchdog."""
    world_size = env_world_size()
    if world_size == 1:
        return Runtime(0, 1, dims, device)
    if device.type != "cpu":
        # One accelerator per process: the local rank picks it.
        device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", "0")))
        getattr(torch, device.type).set_device(device)
    if device.type == "npu":
        from trainbook.parallel import npu

        npu.register()
    if flight_recorder:
        from trainbook.parallel import flight

        flight.enable(BACKENDS[device.type])
    dist.init_process_group(BACKENDS[device.type], timeout=dt.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    # This group's name, the same on every rank and new with each (re)start of the group.
    group = torch.tensor([os.getpid(), time.time_ns()] if rank == 0 else [0, 0], dtype=torch.int64)
    dist.broadcast(group, 0)
    os.environ[GROUP_ENV] = f"{group[0].item()}-{group[1].item()}"
    return Runtime(rank, world_size, dims, device, mesh=dims.build_mesh(device.type))


def watch_store(prefix: str, timeout_s: float = 30.0) -> dist.Store:
    """A connection of its own to the elastic agent's store, under `prefix` and this group's name.

    For threads that must talk to the other ranks while the main thread is inside a collective
    (the hang watchdog): an own socket never waits behind the main thread's requests, and the
    agent's store (the rendezvous endpoint, `TRAINBOOK_AGENT_STORE`, set by `trainbook run`)
    outlives any worker, a stopped rank 0 included. Under a plain torchrun it is the group's
    store at MASTER_ADDR:MASTER_PORT (hosted by rank 0's process).
    """
    host, port = os.environ.get(AGENT_STORE_ENV, f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=dt.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"{prefix}/{os.environ.get(GROUP_ENV, 'group')}", store)
