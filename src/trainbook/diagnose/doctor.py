"""The post-mortem rules of `trainbook doctor`: what went wrong with a run, or what bounds it.

Pure functions over what a run directory holds (read by `read_evidence`): metrics, events,
health.json, and the artefacts the diagnosed failures leave (`oom/breakdown.json`,
`hang/verdict.json`, `incidents/step-N/incident.json`). Each rule returns a `Finding`: a class,
a one-line summary, evidence lines that quote the run's own numbers (which step, which rank,
what share of the step time), the next thing to do, and the README playbook that explains it.

The order of the findings is the verdict: failures first (OOM, hang, NaN/spike, an error, a
process that died), then how the time went. A run with no problem is `healthy`, and its
bound comes second: "healthy; compute-bound: ...".

How time is judged. Every train record's `phases` add up to its `step_time_s` (DESIGN.md); a
record stands for the `log.every_steps` steps up to it, except its evaluation and checkpoint,
which happened once. The first record (start-up, compilation) and the last step's (the final
evaluation and save, which every run pays once) are left out when others remain. Shares of
that time decide:

- straggler: the ranks' data waits (`ranks` in metrics.jsonl) differ by >= STRAGGLER_SHARE of
  the step time, the same rank the slowest in most records (the others wait for it in the
  collectives: their own phases show communication, not the cause);
- data-bound: data wait >= DATA_SHARE; communication-bound: grad_sync >= COMM_SHARE;
  checkpoint-bound: blocking checkpoint time >= CHECKPOINT_SHARE;
- otherwise healthy, bound by the largest of compute (forward + backward + optimizer), data,
  communication, checkpoint and evaluation.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from trainbook.monitor.archive import RunRecord
from trainbook.sizes import human

DATA_SHARE = 0.20
COMM_SHARE = 0.25
CHECKPOINT_SHARE = 0.15
STRAGGLER_SHARE = 0.20

# README sections (under "## Playbooks") each finding points at.
PLAYBOOKS = {
    "oom": "README.md > Playbooks > Out of memory",
    "hang": "README.md > Playbooks > Hangs",
    "nan/spike": "README.md > Playbooks > NaN and loss spikes",
    "time": "README.md > Playbooks > Post-mortem: trainbook doctor",
}


@dataclass(frozen=True)
class Finding:
    kind: str
    """healthy | data-bound | compute-bound | communication-bound | checkpoint-bound |
    evaluation-bound | straggler | oom | hang | nan/spike | failed | died"""
    summary: str
    evidence: list[str] = field(default_factory=list)
    next_step: str = ""
    playbook: str = PLAYBOOKS["time"]

    @property
    def problem(self) -> bool:
        return self.kind != "healthy"


@dataclass
class Evidence:
    """A run directory's facts beyond `RunRecord`: where it was, and what its detectors wrote."""

    run: RunRecord
    health: dict = field(default_factory=dict)
    oom: dict = field(default_factory=dict)
    hang: dict = field(default_factory=dict)
    incidents: list[dict] = field(default_factory=list)
    """incidents/step-N/incident.json, by step."""


def read_evidence(run: RunRecord) -> Evidence:
    path = run.path
    incidents = [_json(p) for p in sorted(path.glob("incidents/step-*/incident.json"), key=_step_of_incident)]
    return Evidence(run, health=_json(path / "health.json"), oom=_json(path / "oom" / "breakdown.json"),
                    hang=_json(path / "hang" / "verdict.json"), incidents=[i for i in incidents if i])


def diagnose(ev: Evidence) -> list[Finding]:
    """Every finding, the verdict first."""
    failures = [f for f in (oom(ev), hang(ev), nonfinite(ev)) if f is not None]
    if not failures:
        ended = failed(ev) or died(ev)
        failures = [ended] if ended is not None else []
    return failures + timing(ev)


def verdict_line(findings: list[Finding]) -> str:
    """The first line: `healthy; compute-bound: ...`, or the first problem's."""
    first = findings[0]
    if first.kind == "healthy" and len(findings) > 1:
        return f"healthy; {findings[1].kind}: {findings[1].summary}"
    return f"{first.kind}: {first.summary}"


# ---- failures ---------------------------------------------------------------------------


def oom(ev: Evidence) -> Finding | None:
    event = _last_event(ev, "oom")
    if event is None and not ev.oom:
        return None
    b = ev.oom
    step, phase = (event or b).get("step"), (event or b).get("phase")
    evidence = [f"events.jsonl: out of memory in step {step}, phase {phase}"]
    measured = b.get("measured") or {}
    sizes = [f"{k} {_bytes(v)}" for k, v in measured.items() if isinstance(v, (int, float))]
    if sizes:
        evidence.append(f"oom/breakdown.json measured on {b.get('device', 'the device')}: " + ", ".join(sizes))
    alternatives = [a for a in b.get("alternatives") or [] if a.get("overrides")]
    for a in alternatives[:3]:
        evidence.append(f"fits by the plan's estimate ({_bytes(a.get('estimate_bytes'))}): " + " ".join(a["overrides"]))
    fix = " ".join(alternatives[0]["overrides"]) if alternatives else "a smaller train.micro_batch_size"
    return Finding("oom", (event or {}).get("verdict") or b.get("verdict") or f"out of memory in step {step}",
                   evidence, f"rerun with {fix} (trainbook plan shows what each layout needs)", PLAYBOOKS["oom"])


def hang(ev: Evidence) -> Finding | None:
    event = _last_event(ev, "hang")
    if event is None and not ev.hang:
        return None
    v = ev.hang
    evidence = [f"hang/verdict.json: step {v.get('step', (event or {}).get('step'))}"
                + (f", collective {v['collective']} #{v.get('seq')}" if v.get("collective") else "")
                + (f", waiting: ranks {v['waiting']}" if v.get("waiting") else "")]
    for s in v.get("stuck") or []:
        evidence.append(f"stuck: rank {s.get('rank')} on {s.get('host')} in step {s.get('step')}, "
                        f"phase {s.get('phase')} (stacks: {s.get('stacks')})")
    stuck = (event or {}).get("stuck_ranks") or [s.get("rank") for s in v.get("stuck") or []]
    return Finding("hang", (event or {}).get("verdict") or v.get("verdict") or "the ranks stopped making progress",
                   evidence, f"read the stuck rank's stacks (hang/rank{stuck[0] if stuck else '<R>'}.txt) and its log",
                   PLAYBOOKS["hang"])


def nonfinite(ev: Evidence) -> Finding | None:
    """A bad step triage caught (diagnose/triage.py): its incident and what was done about it."""
    events = [e for e in ev.run.events if e.get("kind") == "incident"]
    if not events and not ev.incidents:
        return None
    first = ev.incidents[0] if ev.incidents else {}
    event = events[0] if events else {}
    step = first.get("step", event.get("step"))
    kind = first.get("kind") or event.get("problem")
    evidence = [f"{len(events) or len(ev.incidents)} incident(s); first: {kind} at step {step}: "
                f"{first.get('what') or event.get('what')}; {first.get('located') or event.get('located')}"]
    numbers = {k: first.get(k) for k in ("loss", "lr", "grad_norm", "loss_scale") if first.get(k) is not None}
    if numbers:
        evidence.append(f"incidents/step-{step}/incident.json: " + ", ".join(
            f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in numbers.items()))
    reproducible = (first.get("rerun") or {}).get("reproducible", event.get("reproducible"))
    if reproducible is not None:
        evidence.append("reproducible: the re-run of the step on the same batch failed again (data or model state)"
                        if reproducible else "transient: the re-run of the step on the same batch was clean")
    rollbacks = [e for e in ev.run.events if e.get("kind") == "rollback"]
    if rollbacks:
        r = rollbacks[-1]
        evidence.append(f"rolled back at step {r.get('step')} to step {r.get('to_step')}, skipping "
                        f"{r.get('skipped_batches')} batches (global samples {r['skipped_samples'][0]}-"
                        f"{r['skipped_samples'][1] - 1})" if r.get("skipped_samples") else "")
    return Finding("nan/spike", first.get("verdict") or f"{kind} at step {step}", [e for e in evidence if e],
                   f"inspect incidents/step-{step}/ (batch-dp*.json: the batch and its source documents); "
                   "see the [triage] policies", PLAYBOOKS["nan/spike"])


def failed(ev: Evidence) -> Finding | None:
    if ev.run.status != "failed":
        return None
    end = _last_event(ev, "end") or {}
    return Finding("failed", f"the run stopped with an error at step {end.get('step')}: {end.get('error')}",
                   [f"events.jsonl: end status failed at step {end.get('step')}", *_last_position(ev)],
                   "read the error in the rank logs (logs/); resume with `trainbook run --run-dir RUN`")


def died(ev: Evidence) -> Finding | None:
    if ev.run.status != "died":
        return None
    h = ev.health
    step = h.get("step", ev.run.steps)
    where = (f"between steps, after step {step}'s record" if h.get("phase") == "idle"
             else f"in step {step}, phase {h['phase']}" if h.get("phase") else f"after step {step}")
    return Finding("died", f"the process was killed {where} (no end marker, no live process)",
                   [*_last_position(ev), f"status: {ev.run.status_detail}"],
                   "look for the OOM killer or the scheduler (dmesg, the job log); then resume with "
                   "`trainbook run --run-dir RUN`")


def _last_position(ev: Evidence) -> list[str]:
    lines = []
    if ev.health:
        lines.append(f"health.json: step {ev.health.get('step')}, phase {ev.health.get('phase')}, "
                     f"pid {ev.health.get('pid')} on {ev.health.get('host')}")
    if ev.run.train:
        lines.append(f"last train record: step {ev.run.train[-1]['step']} of {ev.run.max_steps}")
    if ev.run.checkpoints:
        lines.append(f"newest checkpoint: checkpoints/{ev.run.checkpoints[-1]} (a resume starts there)")
    return lines


# ---- where the time went ----------------------------------------------------------------


def timing(ev: Evidence) -> list[Finding]:
    """How the time went: the problems by share (largest first), or `healthy` and its bound."""
    records = [r for r in ev.run.train if isinstance(r.get("phases"), dict) and r.get("step_time_s")]
    if not records:
        return [] if ev.run.status in ("died", "failed") else [
            Finding("healthy", "no train records to judge yet", ["metrics.jsonl holds no train line"])]
    steady = _steady(records, ev.run.max_steps)
    shares, total = time_shares(steady)
    span = f"steps {steady[0]['step']}-{steady[-1]['step']}" if len(steady) > 1 else f"step {steady[0]['step']}"
    breakdown = "; ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
    evidence = [f"share of {total:.2f} s over {span} ({len(steady)} records): {breakdown}", *_caveat(ev)]
    problems = [f for f in (straggler(steady), _bound(shares, steady, evidence)) if f is not None and f.problem]
    if problems:
        return problems
    bound = max(shares, key=shares.get)
    return [Finding("healthy", "no failure, and no phase beyond its share", evidence[1:]),
            Finding(f"{_BOUND_NAMES[bound]}-bound", f"{_DESCRIPTIONS[bound]} {shares[bound]:.0%} of step time",
                    evidence, _NEXT[bound])]


_BOUND_NAMES = {"compute": "compute", "data": "data", "grad_sync": "communication", "checkpoint": "checkpoint",
                "eval": "evaluation"}
_DESCRIPTIONS = {"compute": "forward + backward + optimizer", "data": "waiting for data", "grad_sync":
                 "exposed gradient communication (grad_sync)", "checkpoint": "checkpoint blocking",
                 "eval": "evaluation"}
_NEXT = {
    "compute": "faster compute: bf16, train.compile, a larger micro-batch; profile a few steps with "
               "train.profile_steps=[a,b] to see the kernels",
    "data": "feed faster: data.num_workers > 0, prepared shards on local disk; `trainbook bench data RECIPE` "
            "measures the loader alone",
    "grad_sync": "less exposed communication: fewer data-parallel ranks per node, HSDP (parallel.dp_replicate), "
                 "a larger batch per step (train.global_batch_tokens)",
    "checkpoint": "checkpoint.mode=async, or a longer checkpoint.interval_steps",
    "eval": "a longer train.eval_every or fewer train.eval_steps",
}


def time_shares(records: list[dict]) -> tuple[dict[str, float], float]:
    """Each part's share of the run's time over `records`, and that time in seconds. A record
    stands for the steps since the previous one; its evaluation and checkpoint happened once."""
    sums = dict.fromkeys(("compute", "data", "grad_sync", "checkpoint", "eval"), 0.0)
    previous = None
    for r in records:
        steps = r["step"] - previous if previous is not None else 1
        previous = r["step"]
        p = r["phases"]
        once = {k: float(p.get(k) or 0.0) for k in ("checkpoint", "eval")}
        inner = r["step_time_s"] - sum(once.values())
        compute = sum(float(p.get(k) or 0.0) for k in ("forward", "backward", "optimizer"))
        # What no phase claims (none, when the phases add up) counts as compute.
        rest = max(0.0, inner - compute - float(p.get("data") or 0.0) - float(p.get("grad_sync") or 0.0))
        sums["compute"] += (compute + rest) * steps
        sums["data"] += float(p.get("data") or 0.0) * steps
        sums["grad_sync"] += float(p.get("grad_sync") or 0.0) * steps
        for k, v in once.items():
            sums[k] += v
    total = sum(sums.values()) or 1e-12
    return {k: v / total for k, v in sums.items()}, total


def _bound(shares: dict[str, float], records: list[dict], evidence: list[str]) -> Finding | None:
    over = [(shares[k] / limit, k) for k, limit in (("data", DATA_SHARE), ("grad_sync", COMM_SHARE),
                                                   ("checkpoint", CHECKPOINT_SHARE)) if shares[k] >= limit]
    if not over:
        return None
    _, key = max(over)
    worst = max(records, key=lambda r: float(r["phases"].get(key) or 0.0) / r["step_time_s"])
    seconds = float(worst["phases"].get(key) or 0.0)
    lines = [f"{_DESCRIPTIONS[key]}: {shares[key]:.0%} of the run's step time (threshold "
             f"{dict(data=DATA_SHARE, grad_sync=COMM_SHARE, checkpoint=CHECKPOINT_SHARE)[key]:.0%})",
             f"worst: step {worst['step']}, {seconds:.3f} s of {worst['step_time_s']:.3f} s "
             f"({seconds / worst['step_time_s']:.0%})", *evidence]
    return Finding(f"{_BOUND_NAMES[key]}-bound", f"{_DESCRIPTIONS[key]} {shares[key]:.0%} of step time",
                   lines, _NEXT[key])


def straggler(records: list[dict]) -> Finding | None:
    """One rank waits for its data much longer than the others, in most logged steps."""
    spreads = []
    for r in records:
        wait = (r.get("ranks") or {}).get("data_wait_s")
        if wait and r.get("step_time_s"):
            spreads.append(((wait["max"] - wait["min"]) / r["step_time_s"], wait["max_rank"], wait["min_rank"], r))
    if not spreads:
        return None
    slow = statistics.mode(s[1] for s in spreads)
    mine = [s for s in spreads if s[1] == slow]
    median = statistics.median(s[0] for s in spreads)
    if median < STRAGGLER_SHARE or len(mine) * 2 <= len(spreads):
        return None
    share, _, fast, r = max(mine, key=lambda s: s[0])
    wait = r["ranks"]["data_wait_s"]
    return Finding(
        "straggler", f"rank {slow} waits for its data longer than rank {fast} by {median:.0%} of the step time (median)",
        [f"rank {slow} is the slowest to get its data in {len(mine)} of {len(spreads)} records with every rank's times",
         f"worst: step {r['step']}, rank {slow} waited {wait['max']:.3f} s, rank {fast} {wait['min']:.3f} s, "
         f"of a {r['step_time_s']:.3f} s step ({share:.0%})",
         "the other ranks spend that time waiting in collectives: their phases show communication"],
        f"look at rank {slow}'s host and input path (its disk, its data.num_workers, its CPU); "
        f"`trainbook bench data` on that host")


def _steady(records: list[dict], max_steps: int | None) -> list[dict]:
    """Leave out the first record (start-up) and the last step's (the final eval and save)
    while at least two records remain."""
    out = list(records)
    if len(out) > 2 and max_steps is not None and out[-1]["step"] == max_steps:
        out = out[:-1]
    if len(out) > 2:
        out = out[1:]
    return out


def _caveat(ev: Evidence) -> list[str]:
    device = str(ev.run.env.get("device") or "")
    profiled = (ev.run.config.get("train") or {}).get("profile_phases")
    if device and not device.startswith("cpu") and not profiled:
        return [f"on {device} without train.profile_phases the phases are host-side: device work shows where the "
                "host waits (often grad_sync); rerun with train.profile_phases=true before trusting the shares"]
    return []


# ---- reading ----------------------------------------------------------------------------


def _last_event(ev: Evidence, kind: str) -> dict | None:
    found = [e for e in ev.run.events if e.get("kind") == kind]
    return found[-1] if found else None


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _step_of_incident(path: Path) -> int:
    tail = path.parent.name.removeprefix("step-")
    return int(tail) if tail.isdigit() else -1


def _bytes(n) -> str:
    return human(n) if isinstance(n, (int, float)) else "?"
