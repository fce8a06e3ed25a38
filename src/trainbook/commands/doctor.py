"""`trainbook doctor RUN`: a post-mortem verdict over a run directory (diagnose/doctor.py's rules).

Exit code 0: healthy; 1: a problem was found; 2: RUN is not a run directory.
"""

from __future__ import annotations

from pathlib import Path

from trainbook.diagnose.doctor import Finding, diagnose, read_evidence, verdict_line
from trainbook.monitor.archive import load_run


def doctor_command(run_dir: Path) -> tuple[str, int]:
    """(the report, the exit code)."""
    run = load_run(run_dir, need_metrics=False)
    findings = diagnose(read_evidence(run))
    return render(run.path, findings), 1 if findings[0].problem else 0


def render(path: Path, findings: list[Finding]) -> str:
    lines = [verdict_line(findings), f"run: {path}"]
    for f in findings:
        if f.kind == "healthy" and not f.evidence:
            continue
        lines.append("")
        lines.append(f"{f.kind}: {f.summary}")
        lines.extend(f"  - {e}" for e in f.evidence)
        if f.next_step:
            lines.append(f"  next: {f.next_step}")
        lines.append(f"  playbook: {f.playbook}")
    return "\n".join(lines)
