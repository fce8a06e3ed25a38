"""A collective that timed out, explained from what the rank was doing (the phase tracker)."""

from __future__ import annotations

from trainbook.errors import TrainbookError
from trainbook.phase import Phase, PhaseState

# What a rank waits for in each phase (or step detail) when a collective times out.
WAITS: dict[Phase | str, str] = {
    Phase.FORWARD: "FSDP parameter all-gather / tensor-parallel collectives",
    Phase.BACKWARD: "gradient reduce-scatter / all-reduce / tensor-parallel collectives",
    Phase.FORWARD_BACKWARD: "pipeline send/recv between stages",
    "gradient norm": "all-reduce of the gradient norm",
    "gradient unscale": "all-reduce of the fp16 overflow flag",
    "loss report": "all-reduce of the loss",
}


def explain_timeout(error: RuntimeError, state: PhaseState, rank: int, timeout_s: float) -> Exception:
    """One line naming the rank, the step, the phase and what it waited for; any other error
    unchanged."""
    if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
        return error
    doing = state.detail or state.phase.value
    what = WAITS.get(state.detail) or WAITS.get(state.phase) or doing
    return TrainbookError(
        f"rank {rank}: a collective timed out after {timeout_s:g} s in step {state.step}, {doing} ({what}); "
        "another rank is stuck or gone: see its log",
        where="parallel.timeout_s",
    )
