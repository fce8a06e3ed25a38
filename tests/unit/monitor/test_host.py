"""What the host reports about a training process: its own peak memory, its threads' wait for a CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainbook.monitor.host import cpu_times

# Prints its peak memory, then the longest wait for a CPU of any of its threads, as a share of the time, during
# pure-Python work done by a second thread while the main thread sleeps joining it (as the main
# thread sleeps in the intra-op pool's barrier while the worker threads run the kernels).
CHILD = """
import threading, time, torch
from trainbook.monitor.host import cpu_times, cpu_wait_share
from trainbook.parallel.device import peak_memory_bytes
done, release = threading.Event(), threading.Event()
def work():
    sum(i * i for i in range(5_000_000))
    done.set()
    release.wait()  # alive until read: an ended thread's counters are gone (as the pool's are not)
worker = threading.Thread(target=work)
before, start = cpu_times(), time.perf_counter()
worker.start()
done.wait()
share = cpu_wait_share(before, cpu_times(), time.perf_counter() - start)
release.set()
print(peak_memory_bytes(torch.device("cpu")), share)
"""


def _child(cpu: int | None = None) -> tuple[int, float]:
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                         preexec_fn=pin).stdout
    peak, share = out.split()
    return int(peak), float(share)


def test_a_run_started_by_a_large_process_reports_its_own_peak():
    """Linux keeps a replaced image's peak RSS across exec in getrusage; the peak a run reports
    must be its own, or every run a big parent starts (a test runner, a notebook) looks large."""
    ballast = bytearray(768 << 20)
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # touched: resident in this process
    peak, _ = _child()
    del ballast
    assert peak < 512 << 20, peak  # torch imported: a few hundred MiB, not this process's 768+


@pytest.mark.skipif(cpu_times() is None, reason="the kernel does not report run-queue time")
def test_cpu_wait_is_the_time_other_processes_held_the_cpu():
    """Pinned to one CPU beside three processes spinning on it, the child's working thread gets
    about a quarter of that CPU: its threads wait for most of the time they ask for, whatever the
    speed of the machine, although the main thread itself only sleeps."""
    cpu = min(os.sched_getaffinity(0))
    spin = [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(3)]
    try:
        _, share = _child(cpu)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert share > 0.5, share

