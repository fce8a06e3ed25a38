"""`[diagnose]` and `[triage]`: what the failure diagnoses record; what a bad step does to the run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainbook.config.section import Section


class DiagnoseConfig(Section):
    """What the failure diagnoses record beyond what they always do."""

    memory_history: bool = False
    """Record memory for an out-of-memory post-mortem: the bytes each block saves for backward
    (saved-tensor hooks, measured instead of estimated in `oom/breakdown.json`), and on CUDA the
    allocator's history, dumped to `oom/snapshot.pickle` (pytorch.org/memory_viz). Costs a hook
    per saved tensor."""


class TriageConfig(Section):
    """What a bad step does to the run (diagnose/triage.py). A step is bad when its loss or
    gradient norm is non-finite, or its loss spikes by the robust rule; every rank judges the same
    global values and they agree in one collective, before the update. The step is then re-run
    once with hooks on every module (transient or reproducible; the first module whose output or
    gradient is non-finite), and `incidents/step-N/` holds the batch, its source documents and
    the step's numbers. A transient fault (the re-run is clean) trains on with the re-run's
    update; a reproducible one meets the policy: `stop` (exit 3 with the verdict), `skip` (no
    update: weights and optimizer state stay as they were; the step's data is spent), `rollback`
    (reload the newest checkpoint at least `rollback_steps_back` steps before the bad step and
    skip the next `rollback_skip_batches` batches of data after it), `ignore` (no judgement: the
    update is applied, as without triage). An fp16 overflow is the loss scaler's skip, not a bad step."""

    on_nonfinite: Literal["stop", "skip", "rollback", "ignore"] = "stop"
    """Policy for a non-finite loss or gradient norm."""
    on_spike: Literal["stop", "skip", "rollback", "ignore"] = "ignore"
    """Policy for a loss spike: `spike_z` robust sigmas above the trend of the last `window` good
    steps (the `loss_spike` alert's rule; judged once the LR warmup is over and a window has passed)."""
    spike_z: float = Field(default=6.0, gt=0)
    """Robust z-score above which a step's loss is a spike."""
    window: int = Field(default=50, ge=5)
    """Good steps the spike rule's trend is fitted to."""
    rollback_steps_back: int = Field(default=0, ge=0)
    """Rollback restarts from the newest checkpoint at least this many steps before the bad step
    (PaLM restarted about 100 steps before a spike); 0: the newest checkpoint."""
    rollback_skip_batches: int = Field(default=200, ge=0)
    """Batches (optimizer steps' worth of data) skipped after the checkpoint rolled back to (PaLM
    skipped 200-500); recorded in events.jsonl, so a later resume from that checkpoint skips them too."""
    max_rollbacks: int = Field(default=5, ge=1)
    """Rollbacks a run may make; one more bad step is a stop (data is not the cause)."""
