"""What `trainbook doctor` says of a run (`Finding`) and what it reads to say it (`Evidence`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainbook.monitor.archive import RunRecord
from trainbook.runs import RunPaths

# README sections (under "## Playbooks") each finding points at.
PLAYBOOKS = {
    "oom": "README.md > Playbooks > Out of memory",
    "hang": "README.md > Playbooks > Hangs",
    "nan/spike": "README.md > Playbooks > NaN and loss spikes",
    "time": "README.md > Playbooks > Post-mortem: trainbook doctor",
    "rl": "README.md > Precision and pretrained weights > Reinforcement learning with verifiable rewards",
}


@dataclass(frozen=True)
class Finding:
    kind: str
    """healthy | data-bound | compute-bound | communication-bound | checkpoint-bound |
    evaluation-bound | straggler | oom | hang | nan/spike | failed | died; for GRPO runs
    reward-collapse | entropy-collapse | kl-blowup | no-signal | reward-errors, and `learning`
    (not a problem: how a post-training run's figures moved)"""
    summary: str
    evidence: list[str] = field(default_factory=list)
    next_step: str = ""
    playbook: str = PLAYBOOKS["time"]

    @property
    def problem(self) -> bool:
        return self.kind not in ("healthy", "learning")


@dataclass
class Evidence:
    """A run directory's facts beyond `RunRecord`: where it was, and what its detectors wrote."""

    run: RunRecord
    paths: RunPaths
    """The run directory's files, by name (what the evidence lines call them: `paths.name`)."""
    health: dict = field(default_factory=dict)
    oom: dict = field(default_factory=dict)
    hang: dict = field(default_factory=dict)
    incidents: list[dict] = field(default_factory=list)
    """incidents/step-N/incident.json, by step."""
