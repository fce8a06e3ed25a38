"""What the host did to the training thread: time it was ready to run but waited for a CPU.

A step that takes longer because other processes hold the CPUs (an oversubscribed node, a
neighbour's job) looks like any other slowdown in tokens/s. Linux counts, per thread, the time
spent runnable on a run queue (`/proc/self/schedstat`, second field, ns); its share of a step's
wall time tells contention apart from a slower input pipeline (a thread waiting for data sleeps,
it is not runnable). The training thread is the process's main thread, which launches the
kernels on an accelerator and takes part in every CPU kernel.
"""

from __future__ import annotations

SCHEDSTAT = "/proc/self/schedstat"


def cpu_wait_s() -> float | None:
    """Seconds the main thread has spent runnable but not running since it started; None where
    the kernel does not say (not Linux, or schedstats compiled out)."""
    try:
        with open(SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
