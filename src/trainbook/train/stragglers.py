"""Straggler probes: on a logged step, how long each rank waits for the others, and where.

Ranks run in lockstep, so every rank's step takes as long as the slowest one's: what a fast rank
does with its spare time is wait inside a collective. The probes make that wait measurable at
known places: a tiny all-reduce of the world group, timed on each rank, at the step's start, after
each micro-batch's data, and after backward (the step calls them: train/step.py). A rank's wait
in a probe is how much later than itself the last rank got there since the previous collective;
the rank the others wait for is the straggler (monitor/alerts.py, rule `straggler`, judges it).

The probe at the start absorbs what came before the step (rank 0 alone writes the records and
judges the alerts between steps), so the data probes time the data phase only. The probes run on
the logging cadence's steps only, with the rule on and more than one process, each on its own
one-element tensor: the step's numbers are untouched, and the other steps pay nothing.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from trainbook.diagnose.profile import device_sync
from trainbook.monitor.report import RankTimes
from trainbook.parallel.runtime import Runtime
from trainbook.phase import Phase, PhaseTracker

PROBES = ("start", "data", "compute")


class StragglerProbes:
    """Called by the step at each probe (`probe("data")`); `figures` and `rank_times` turn one
    step's waits and phases into every rank's RankTimes (one row of the logging cadence's gather)."""

    def __init__(self, rt: Runtime, tracker: PhaseTracker):
        self.tracker = tracker
        self._flag = torch.zeros(1, device=rt.device)  # its own tensor: no training value goes through it
        self._sync = device_sync(rt.device)  # on an accelerator: arrive with this rank's queued work done
        self.waits = dict.fromkeys(PROBES, 0.0)
        self.hosts = rt.all_gather_objects(socket.gethostname())  # once, at the start: every rank builds this

    def __call__(self, where: str) -> None:
        if where == "start":
            self.waits = dict.fromkeys(PROBES, 0.0)
        if self._sync is not None:  # the device work queued in the phase it ends is that phase's
            self._sync()
        self.tracker.enter(Phase.GRAD_SYNC, detail=f"straggler probe ({where})")
        start = time.perf_counter()
        dist.all_reduce(self._flag)
        if self._sync is not None:
            self._sync()
        self.waits[where] += time.perf_counter() - start

    def figures(self, phases: dict[str, float]) -> list[float]:
        """This rank's [data, compute, comm, data-probe wait, compute-probe wait] seconds of the step
        whose `phases` (the Step's result) these probes timed."""
        probed = sum(self.waits.values())
        compute = phases["forward"] + phases["backward"] + phases["optimizer"]
        return [phases["data"], compute, max(phases["grad_sync"] - probed, 0.0), self.waits["data"],
                self.waits["compute"]]

    def rank_times(self, step_times: list[float], rows: list[list[float]]) -> RankTimes:
        """Every rank's `figures` (`rows`, indexed by rank) with its step time and host."""
        data, compute, comm, wait_data, wait_compute = (list(column) for column in zip(*rows))
        return RankTimes(self.hosts, step_times, data, compute, comm, wait_data, wait_compute)
