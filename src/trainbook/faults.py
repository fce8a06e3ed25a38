"""Fault points: named places where a test can kill the process with a real SIGKILL.

`TRAINBOOK_FAULT=<point>@<step>` (or just `<point>`, any step) makes `fault_point(point, step)`
send SIGKILL to its own process at that instant. `TRAINBOOK_FAULT_RANK=<r>` limits it to one
rank; `TRAINBOOK_FAULT_ACTION=hang` makes that rank stop answering instead (collective timeouts), and
`TRAINBOOK_FAULT_ACTION=raise` raises an exception there (a run that fails with a Python error). Crash-safety tests use it to die at exact
moments (between a checkpoint's manifest and its rename, after a given step, ...) that a signal
sent from outside could only hit by luck. Unset, it costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "TRAINBOOK_FAULT"


def fault_point(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, at = spec.partition("@")
    rank = os.environ.get("TRAINBOOK_FAULT_RANK")
    if name != point or (at and int(at) != step) or (rank is not None and rank != os.environ.get("RANK", "0")):
        return
    action = os.environ.get("TRAINBOOK_FAULT_ACTION")
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "raise":
        raise RuntimeError(f"fault injected at {point} (step {step})")
    os.kill(os.getpid(), signal.SIGKILL)
