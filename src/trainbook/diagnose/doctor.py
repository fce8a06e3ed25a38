"""The post-mortem rules of `trainbook doctor`: what went wrong with a run, or what bounds it.

Pure functions over what a run directory holds (read by `read_evidence`): metrics, events,
health.json, and the artefacts the diagnosed failures leave (`oom/breakdown.json`,
`hang/verdict.json`, `incidents/step-N/incident.json`). Each rule returns a `Finding`: a class,
a one-line summary, evidence lines that quote the run's own numbers (which step, which rank,
what share of the step time), the next thing to do, and the README playbook that explains it.

The order of the findings is the verdict: failures first (OOM, hang, NaN/spike, an error, a
process that died), then how the time went. A run with no problem is `healthy`, and its
bound comes second: "healthy; compute-bound: ...".

How the time went is judged in diagnose/doctor_time.py.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from trainbook.diagnose.doctor_time import timing
from trainbook.diagnose.findings import PLAYBOOKS, Evidence, Finding
from trainbook.errors import TrainbookError
from trainbook.monitor.archive import RunRecord
from trainbook.runs import RunPaths
from trainbook.sizes import human

# What doctor reads of each file other modules write: the keys it needs. A record without one is
# an error naming the file and the key (exit 2), never a `None` in the report. The writers:
# monitor/health.py (health.json), diagnose/oom.py (oom/breakdown.json and the `oom` event),
# diagnose/hang.py (hang/verdict.json, the `hang` event), diagnose/triage.py (incident.json, the
# `incident` event), train/trainer.py (metrics.jsonl, the `end` and `rollback` events); a
# doctor test judges the files real failures leave, so a writer that renames a key fails it.
HEALTH_KEYS = ("state", "step", "phase", "pid", "host")
BREAKDOWN_KEYS = ("step", "phase", "device", "measured", "alternatives", "verdict")
ALTERNATIVE_KEYS = ("overrides", "estimate_bytes")
HANG_KEYS = ("step", "collective", "seq", "waiting", "stuck", "verdict")
STUCK_KEYS = ("rank", "host", "step", "phase", "stacks")
INCIDENT_KEYS = ("step", "kind", "what", "located", "loss", "lr", "grad_norm", "loss_scale", "rerun", "verdict")
EVENT_KEYS = {"oom": ("phase", "verdict"), "hang": ("verdict", "stuck_ranks"),
              "incident": ("problem", "what", "located", "reproducible"),
              "rollback": ("to_step", "skipped_batches", "skipped_samples"), "end": ("status",)}
TRAIN_KEYS = ("step", "step_time_s", "phases")
PHASE_KEYS = ("data", "forward", "backward", "grad_sync", "optimizer", "checkpoint", "eval")
WAIT_KEYS = ("max", "min", "max_rank", "min_rank")

RL_ALERTS = {"reward_collapse": "reward-collapse", "entropy_collapse": "entropy-collapse", "kl_blowup": "kl-blowup",
             "zero_std_groups": "no-signal"}
NO_SIGNAL_SHARE = 0.9  # the median record's share of groups whose rewards were all equal


def read_evidence(run: RunRecord) -> Evidence:
    """The run's evidence, every record checked for the keys the rules read (a TrainbookError
    naming the file and the key otherwise)."""
    paths = RunPaths.of(run.path)
    for e in run.events:
        if e.get("kind") in EVENT_KEYS:
            need(e, EVENT_KEYS[e["kind"]] + ("step",) + (("error",) if e.get("status") == "failed" else ()),
                 f"{paths.events} ({e['kind']} event of step {e.get('step')})")
    for r in run.train:
        where = f"{paths.metrics} (train record of step {r['step']})"
        need(r, TRAIN_KEYS, where)
        need(r["phases"], PHASE_KEYS, where, "phases.")
        if r.get("ranks") is not None:  # null in a one-process run
            need(r["ranks"], ("data_wait_s",), where, "ranks.")
            need(r["ranks"]["data_wait_s"], WAIT_KEYS, where, "ranks.data_wait_s.")
    if run.env:
        need(run.env, ("device",), str(paths.env))
    need(run.config, ("train",), str(paths.config))
    need(run.config["train"], ("profile_phases",), str(paths.config), "train.")
    health = _json(paths.health, HEALTH_KEYS)
    oom = _json(_breakdown(paths), BREAKDOWN_KEYS)
    for a in oom["alternatives"] if oom else ():
        need(a, ALTERNATIVE_KEYS, str(_breakdown(paths)), "alternatives[].")
    hang = _json(_hang_verdict(paths), HANG_KEYS)
    for s in hang["stuck"] if hang else ():
        need(s, STUCK_KEYS, str(_hang_verdict(paths)), "stuck[].")
    incidents = []
    for p in sorted(paths.incidents.glob("step-*/incident.json"), key=_step_of_incident):
        incident = _json(p, INCIDENT_KEYS)
        need(incident["rerun"], ("reproducible",), str(p), "rerun.")
        incidents.append(incident)
    return Evidence(run, paths, health=health, oom=oom, hang=hang, incidents=incidents)


def need(record, keys: tuple[str, ...], where: str, prefix: str = "") -> None:
    """Every one of `keys` in `record` (a JSON object), or the one-line error naming the file
    and the first key that is missing."""
    if not isinstance(record, dict):
        raise TrainbookError(f"{prefix.rstrip('.[]') or 'record'}: not a JSON object: {record!r:.60}", where=where)
    for key in keys:
        if key not in record:
            raise TrainbookError(f"{prefix}{key}: missing (written by another version of trainbook, or "
                                 "damaged): doctor cannot judge the run without it", where=where)


def diagnose(ev: Evidence) -> list[Finding]:
    """Every finding, the verdict first."""
    failures = [f for f in (oom(ev), hang(ev), nonfinite(ev)) if f is not None]
    if not failures:
        ended = failed(ev) or died(ev)
        failures = [ended] if ended is not None else []
    learned, trend = learning(ev)
    found = failures + learned + timing(ev)
    if trend and not learned:  # how a post-training run's figures moved, after the verdict
        found.append(Finding("learning", "how the objective's figures moved", trend, playbook=PLAYBOOKS["rl"]))
    return found


# ---- post-training ----------------------------------------------------------------------


def learning(ev: Evidence) -> tuple[list[Finding], list[str]]:
    """A GRPO or DPO run's learning: its problems (the RL alerts it fired, groups that taught
    nothing, reward functions that raised) and the lines saying how its figures moved."""
    train = ev.run.train
    if not any("reward" in r or "rewards/margins" in r for r in train):
        return [], []
    name = ev.paths.name
    trend = [_trend(train, key, label) for key, label in (
        ("reward", "reward"), ("entropy", "entropy"), ("kl", "KL"), ("completions/mean_length", "completion length"),
        ("rewards/accuracies", "rewards/accuracies"), ("rewards/margins", "rewards/margins"))]
    trend = [t for t in trend if t]
    found = []
    for e in ev.run.events:
        kind = RL_ALERTS.get(e.get("rule")) if e.get("kind") == "alert" else None
        if kind is not None and not any(f.kind == kind for f in found):
            kept = sorted(ev.paths.incidents.glob(f"step-{e.get('step')}/rollout-dp*.json"))
            found.append(Finding(kind, e.get("message", ""), [
                f"{name(ev.paths.events)}: alert {e['rule']} at step {e.get('step')}",
                *[f"{name(p)}: that step's rollout (prompts, completions, rewards, advantages)" for p in kept[:1]],
                *([] if found else trend)], _RL_NEXT[kind], PLAYBOOKS["rl"]))
    flat = [r["frac_reward_zero_std"] for r in train if isinstance(r.get("frac_reward_zero_std"), (int, float))]
    if flat and statistics.median(flat) >= NO_SIGNAL_SHARE and not any(f.kind == "no-signal" for f in found):
        found.append(Finding("no-signal", f"in the median step {statistics.median(flat):.0%} of the groups scored "
                             "alike: their advantages are 0 and they train nothing",
                             [f"{name(ev.paths.metrics)}: frac_reward_zero_std over {len(flat)} records",
                              *([] if found else trend)],
                             _RL_NEXT["no-signal"], PLAYBOOKS["rl"]))
    rollouts = sorted(ev.paths.incidents.glob("step-*/rollout-dp*.json"), key=_step_of_incident)
    errors = [(p, r) for p, r in ((p, json.loads(p.read_text())) for p in rollouts) if r.get("errors")]
    if errors:
        path, first = errors[0]
        found.append(Finding("reward-errors", f"a reward function raised in {len(errors)} rollout(s); those rewards "
                             "are unknown", [f"{name(path)}: {first['errors'][0]}"],
                             "fix or guard the reward function (a None reward leaves one completion out)",
                             PLAYBOOKS["rl"]))
    return found, trend


_RL_NEXT = {
    "reward-collapse": "a lower optim.lr, a KL term (grpo.kl_coef) or a tighter clip; resume from a checkpoint "
                       "before the collapse",
    "entropy-collapse": "a lower optim.lr, clip_high above clip_low (DAPO's 0.28), a higher grpo.temperature",
    "kl-blowup": "a lower optim.lr or a larger grpo.kl_coef",
    "no-signal": "prompts of the model's level (neither always nor never solved), a reward that tells "
                 "completions apart, a larger grpo.group_size",
}


def _trend(records: list[dict], key: str, label: str) -> str | None:
    """"LABEL a -> b (first and last quarter of the records)", or None without the figure."""
    values = [r[key] for r in records if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    if len(values) < 2:
        return None
    quarter = max(1, len(values) // 4)
    head, tail = statistics.mean(values[:quarter]), statistics.mean(values[-quarter:])
    return f"{label} {head:.4g} -> {tail:.4g} (means of the first and last {quarter} of {len(values)} records)"


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
    b, name = ev.oom, ev.paths.name
    step, phase = (event or b)["step"], (event or b)["phase"]
    evidence = [f"{name(ev.paths.events)}: out of memory in step {step}, phase {phase}"]
    alternatives = []
    if b:
        sizes = [f"{k} {_bytes(v)}" for k, v in b["measured"].items() if isinstance(v, (int, float))]
        evidence.append(f"{name(_breakdown(ev.paths))} measured on {b['device']}: " + ", ".join(sizes))
        alternatives = [a for a in b["alternatives"] if a["overrides"]]
    for a in alternatives[:3]:
        evidence.append(f"fits by the plan's estimate ({_bytes(a['estimate_bytes'])}): " + " ".join(a["overrides"]))
    fix = " ".join(alternatives[0]["overrides"]) if alternatives else "a smaller train.micro_batch_size"
    return Finding("oom", (event or b)["verdict"], evidence,
                   f"rerun with {fix} (trainbook plan shows what each layout needs)", PLAYBOOKS["oom"])


def hang(ev: Evidence) -> Finding | None:
    event = _last_event(ev, "hang")
    if event is None and not ev.hang:
        return None
    v, name = ev.hang, ev.paths.name
    if v:
        evidence = [f"{name(_hang_verdict(ev.paths))}: step {v['step']}"
                    + (f", collective {v['collective']} #{v['seq']}" if v["collective"] else "")
                    + (f", waiting: ranks {v['waiting']}" if v["waiting"] else "")]
        evidence += [f"stuck: rank {s['rank']} on {s['host']} in step {s['step']}, phase {s['phase']} "
                     f"(stacks: {s['stacks']})" for s in v["stuck"]]
    else:
        evidence = [f"{name(ev.paths.events)}: hang in step {event['step']} "
                    f"(no {name(_hang_verdict(ev.paths))})"]
    stuck = event["stuck_ranks"] if event else [s["rank"] for s in v["stuck"]]
    stacks = ev.paths.hang / f"rank{stuck[0] if stuck else '<R>'}.txt"
    return Finding("hang", (event or v)["verdict"], evidence,
                   f"read the stuck rank's stacks ({name(stacks)}) and its log", PLAYBOOKS["hang"])


def nonfinite(ev: Evidence) -> Finding | None:
    """A bad step triage caught (diagnose/triage.py): its incident and what was done about it."""
    events = [e for e in ev.run.events if e.get("kind") == "incident"]
    if not events and not ev.incidents:
        return None
    if ev.incidents:
        first = ev.incidents[0]
        step, kind, what, located = first["step"], first["kind"], first["what"], first["located"]
        reproducible, summary = first["rerun"]["reproducible"], first["verdict"]
    else:  # the event alone (its incident directory is gone)
        first = events[0]
        step, kind, what, located = first["step"], first["problem"], first["what"], first["located"]
        reproducible, summary = first["reproducible"], f"{kind} at step {step}"
    evidence = [f"{len(events) or len(ev.incidents)} incident(s); first: {kind} at step {step}: {what}; {located}"]
    if ev.incidents:
        numbers = {k: first[k] for k in ("loss", "lr", "grad_norm", "loss_scale") if first[k] is not None}
        evidence.append(f"{ev.paths.name(_incident_dir(ev.paths, step) / 'incident.json')}: " + ", ".join(
            f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in numbers.items()))
    evidence.append("reproducible: the re-run of the step on the same batch failed again (data or model state)"
                    if reproducible else "transient: the re-run of the step on the same batch was clean")
    rollbacks = [e for e in ev.run.events if e.get("kind") == "rollback"]
    if rollbacks:
        r = rollbacks[-1]
        start, end = r["skipped_samples"]
        evidence.append(f"rolled back at step {r['step']} to step {r['to_step']}, skipping {r['skipped_batches']} "
                        f"batches (global samples {start}-{end - 1})")
    return Finding("nan/spike", summary, evidence,
                   f"inspect {ev.paths.name(_incident_dir(ev.paths, step))}/ (batch-dp*.json: the batch and "
                   "its source documents); see the [triage] policies", PLAYBOOKS["nan/spike"])


def failed(ev: Evidence) -> Finding | None:
    end = _last_event(ev, "end")
    if ev.run.status != "failed" or end is None:
        return None
    name = ev.paths.name
    return Finding("failed", f"the run stopped with an error at step {end['step']}: {end['error']}",
                   [f"{name(ev.paths.events)}: end status failed at step {end['step']}", *_last_position(ev)],
                   f"read the error in the rank logs ({name(ev.paths.logs)}/); resume with "
                   "`trainbook run --run-dir RUN`")


def died(ev: Evidence) -> Finding | None:
    if ev.run.status != "died":
        return None
    h = ev.health
    if h:
        step = h["step"]
        where = (f"between steps, after step {step}'s record" if h["phase"] == "idle"
                 else f"in step {step}, phase {h['phase']}")
    else:
        where = f"after step {ev.run.steps}"
    return Finding("died", f"the process was killed {where} (no end marker, no live process)",
                   [*_last_position(ev), f"status: {ev.run.status_detail}"],
                   "look for the OOM killer or the scheduler (dmesg, the job log); then resume with "
                   "`trainbook run --run-dir RUN`")


def _last_position(ev: Evidence) -> list[str]:
    lines = []
    if ev.health:
        h = ev.health
        lines.append(f"{ev.paths.name(ev.paths.health)}: step {h['step']}, phase {h['phase']}, pid {h['pid']} "
                     f"on {h['host']}")
    if ev.run.train:
        lines.append(f"last train record: step {ev.run.train[-1]['step']} of {ev.run.max_steps}")
    if ev.run.checkpoints:
        newest = ev.paths.checkpoints / ev.run.checkpoints[-1]
        lines.append(f"newest checkpoint: {ev.paths.name(newest)} (a resume starts there)")
    return lines


# ---- reading ----------------------------------------------------------------------------


def _last_event(ev: Evidence, kind: str) -> dict | None:
    found = [e for e in ev.run.events if e.get("kind") == kind]
    return found[-1] if found else None


def _json(path: Path, keys: tuple[str, ...]) -> dict:
    """A JSON object file with `keys` ({} when the file does not exist: that failure left none)."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TrainbookError(f"not valid JSON: {e}", where=str(path)) from None
    need(value, keys, str(path))
    return value


def _breakdown(paths: RunPaths) -> Path:
    """The OOM breakdown (diagnose/oom.py)."""
    return paths.oom / "breakdown.json"


def _hang_verdict(paths: RunPaths) -> Path:
    """The hang verdict (diagnose/hang.py)."""
    return paths.hang / "verdict.json"


def _incident_dir(paths: RunPaths, step: int) -> Path:
    """Step `step`'s incident folder (diagnose/triage.py)."""
    return paths.incidents / f"step-{step}"


def _step_of_incident(path: Path) -> int:
    tail = path.parent.name.removeprefix("step-")
    return int(tail) if tail.isdigit() else -1


def _bytes(n) -> str:
    return human(n) if isinstance(n, (int, float)) else "?"
