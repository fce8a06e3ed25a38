"""What the host did to the training process: time its threads were ready to run but waited for a CPU.

A step that takes longer because other processes hold the CPUs (an oversubscribed node, a
neighbour's job) looks like any other slowdown in tokens/s. Linux counts, per thread, the time
spent on a CPU and the time spent runnable on a run queue (`/proc/<pid>/task/<tid>/schedstat`,
first and second fields, ns). Over a step, the longest wait of any thread as a share of the
step's time tells contention apart from a slower input pipeline (a thread waiting for data
sleeps: it is neither running nor runnable).

Every thread counts, not only the main one: on a CPU the intra-op worker threads do the kernels
while the main thread sleeps in their barrier, so the main thread alone can show no wait while
the work is starved; on an accelerator the launching thread is the one that runs.
"""

from __future__ import annotations

import os

TASKS = "/proc/self/task"

CpuTimes = dict[int, int]
"""Thread id -> ns it was runnable but waiting for a CPU since it started."""


def cpu_times() -> CpuTimes | None:
    """Every thread's run-queue time now; None where the kernel does not say (not Linux, or
    schedstats compiled out)."""
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    times: CpuTimes = {}
    for tid in tids:
        try:
            with open(f"{TASKS}/{tid}/schedstat") as f:
                times[int(tid)] = int(f.read().split()[1])
        except (OSError, ValueError):
            continue  # the thread ended between listing and reading
    return times or None


def cpu_wait_share(before: CpuTimes | None, after: CpuTimes | None, elapsed_s: float) -> float | None:
    """The longest any one thread of the process waited for a CPU between two readings, as a share
    of the `elapsed_s` between them: ~0 on an idle machine, ~1 - 1/k for a thread that shares
    its CPU with k - 1 others all the time. A step that sleeps (waiting for data) shows little,
    however busy the machine. A thread started in between counts from its start; one that
    ended is lost."""
    if before is None or after is None or elapsed_s <= 0:
        return None
    waited = max((w - before.get(tid, 0) for tid, w in after.items()), default=0)
    return min(1.0, waited / 1e9 / elapsed_s)
