"""What the host reports about a training process: its own peak memory, its wait for a CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainbook.monitor.host import cpu_wait_s

# Prints its peak memory, then the seconds it waited for a CPU during ~1 s of pure-Python work
# and the seconds that work took.
CHILD = """
import time, torch
from trainbook.monitor.host import cpu_wait_s
from trainbook.parallel.device import peak_memory_bytes
w, t = cpu_wait_s(), time.perf_counter()
sum(i * i for i in range(5_000_000))
print(peak_memory_bytes(torch.device("cpu")), cpu_wait_s() - w, time.perf_counter() - t)
"""


def _child(cpu: int | None = None) -> tuple[int, float, float]:
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                         preexec_fn=pin).stdout
    peak, waited, seconds = out.split()
    return int(peak), float(waited), float(seconds)


def test_a_run_started_by_a_large_process_reports_its_own_peak():
    """Linux keeps a replaced image's peak RSS across exec in getrusage; the peak a run reports
    must be its own, or every run a big parent starts (a test runner, a notebook) looks large."""
    ballast = bytearray(768 << 20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touched: resident in this process
    peak, _, _ = _child()
    del ballast
    assert peak < 512 << 20, peak  # torch imported: a few hundred MiB, not this process's 768+


@pytest.mark.skipif(cpu_wait_s() is None, reason="the kernel does not report run-queue time")
def test_cpu_wait_is_the_time_other_processes_held_the_cpu():
    """Pinned to one CPU beside three processes spinning on it, the child gets about a quarter of
    that CPU: it waits for most of its time, whatever the speed of the machine."""
    cpu = min(os.sched_getaffinity(0))
    spin = [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(3)]
    try:
        _, waited, seconds = _child(cpu)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert waited > 0.5 * seconds, (waited, seconds)
