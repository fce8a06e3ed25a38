"""Fault points: named places where a test can kill the process with a real SIGKILL.

`TRAINBOOK_FAULT=<point>@<step>` (or just `<point>`, any step) makes `fault_point(point, step)`
send SIGKILL to its own process at that instant. Crash-safety tests use it to die at exact
moments (between a checkpoint's manifest and its rename, after a given step, ...) that a signal
sent from outside could only hit by luck. Unset, it costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "TRAINBOOK_FAULT"


def fault_point(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, at = spec.partition("@")
    if name == point and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)
