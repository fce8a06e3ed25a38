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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainbook.errors import TrainbookError
from trainbook.monitor.archive import RunRecord
from trainbook.runs import RunPaths
from trainbook.sizes import human

DATA_SHARE = 0.20
COMM_SHARE = 0.25
CHECKPOINT_SHARE = 0.15
STRAGGLER_SHARE = 0.20

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

# README sections (under "## Playbooks") each finding points at.
PLAYBOOKS = {
    "oom": "README.md > Playbooks > Out of memory",
    "hang": "README.md > Playbooks > Hangs",
    "nan/spike": "README.md > Playbooks > NaN and loss spikes",
    "time": "README.md > Playbooks > Post-mortem: trainbook doctor",
    "rl": "README.md > Precision and pretrained weights > Reinforcement learning with verifiable rewards",
}
RL_ALERTS = {"reward_collapse": "reward-collapse", "entropy_collapse": "entropy-collapse", "kl_blowup": "kl-blowup",
             "zero_std_groups": "no-signal"}
ROLLOUT_TIMES = ("time/rollout_s", "time/reward_s", "time/reference_s")  # train/grpo.py: inside the data phase
NO_SIGNAL_SHARE = 0.9  # the median record's share of groups whose rewards were all equal


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


# ---- where the time went ----------------------------------------------------------------


def timing(ev: Evidence) -> list[Finding]:
    """How the time went: the problems by share (largest first), or `healthy` and its bound."""
    records = [r for r in ev.run.train if r["step_time_s"]]  # keys checked by read_evidence
    if not records:
        return [] if ev.run.status in ("died", "failed") else [
            Finding("healthy", "no train records to judge yet",
                    [f"{ev.paths.name(ev.paths.metrics)} holds no train line"])]
    steady = _steady(records, ev.run.max_steps)
    shares, total = time_shares(steady)
    span = f"steps {steady[0]['step']}-{steady[-1]['step']}" if len(steady) > 1 else f"step {steady[0]['step']}"
    # By the share as printed, ties in the phases' own order: 0.04% and 0.02% both print 0%.
    breakdown = "; ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -round(kv[1] * 100)))
    evidence = [f"share of {total:.2f} s over {span} ({len(steady)} records): {breakdown}", *_caveat(ev)]
    problems = [f for f in (straggler(steady), _bound(shares, steady, evidence, lambda: _remedies(ev)))
                if f is not None and f.problem]
    if problems:
        return problems
    bound = max(shares, key=shares.get)
    return [Finding("healthy", "no failure, and no phase beyond its share", evidence[1:]),
            Finding(f"{_BOUND_NAMES[bound]}-bound", f"{_DESCRIPTIONS[bound]} {shares[bound]:.0%} of step time",
                    evidence, _NEXT[bound])]


_BOUND_NAMES = {"compute": "compute", "data": "data", "grad_sync": "communication", "checkpoint": "checkpoint",
                "eval": "evaluation", "rollout": "rollout"}
_DESCRIPTIONS = {"compute": "forward + backward + optimizer", "data": "waiting for data", "grad_sync":
                 "exposed gradient communication (grad_sync)", "checkpoint": "checkpoint blocking",
                 "eval": "evaluation", "rollout": "GRPO's rollout (sampling, rewards, reference log-probs)"}
_NEXT = {
    "compute": "faster compute: bf16, train.compile, a larger micro-batch; profile a few steps with "
               "train.profile_steps=[a,b] to see the kernels",
    "data": "feed faster: data.num_workers > 0, prepared shards on local disk; `trainbook bench data RECIPE` "
            "measures the loader alone",
    "grad_sync": "less exposed communication: fewer data-parallel ranks per node, HSDP (parallel.dp_replicate), "
                 "a larger batch per step (train.global_batch_tokens)",
    "checkpoint": "checkpoint.mode=async, or a longer checkpoint.interval_steps",
    "eval": "a longer train.eval_every or fewer train.eval_steps",
    "rollout": "shorter completions (grpo.max_new_tokens), a faster reward function; sampling is the run's own "
               "model (time/rollout_s, time/reward_s, time/reference_s in metrics.jsonl split it)",
}


def time_shares(records: list[dict]) -> tuple[dict[str, float], float]:
    """Each part's share of the run's time over `records`, and that time in seconds. A record
    stands for the steps since the previous one; its evaluation and checkpoint happened once."""
    sums = dict.fromkeys(("compute", "data", "grad_sync", "checkpoint", "eval"), 0.0)
    if any(ROLLOUT_TIMES[0] in r for r in records):  # GRPO: the rollout runs in the data phase
        sums["rollout"] = 0.0
    previous = None
    for r in records:
        steps = r["step"] - previous if previous is not None else 1
        previous = r["step"]
        p = r["phases"]
        once = {k: float(p[k]) for k in ("checkpoint", "eval")}
        inner = r["step_time_s"] - sum(once.values())
        compute = sum(float(p[k]) for k in ("forward", "backward", "optimizer"))
        # What no phase claims (none, when the phases add up) counts as compute.
        rest = max(0.0, inner - compute - float(p["data"]) - float(p["grad_sync"]))
        sums["compute"] += (compute + rest) * steps
        rollout = min(float(p["data"]), sum(float(r.get(k) or 0.0) for k in ROLLOUT_TIMES))
        if "rollout" in sums:
            sums["rollout"] += rollout * steps
        sums["data"] += (float(p["data"]) - (rollout if "rollout" in sums else 0.0)) * steps
        sums["grad_sync"] += float(p["grad_sync"]) * steps
        for k, v in once.items():
            sums[k] += v
    total = sum(sums.values()) or 1e-12
    return {k: v / total for k, v in sums.items()}, total


def _remedies(ev: Evidence) -> list[str]:
    """Gradient compression for this run's layout, with the bytes it would save (plan's arithmetic:
    parallel/plan_comm.py); none where the run's config or layout cannot be read back."""
    from trainbook.config.load import validate, with_defaults
    from trainbook.parallel.dims import ParallelDims
    from trainbook.parallel.plan_comm import compression_remedies
    from trainbook.parallel.plan_memory import PlanInputs

    layout = (ev.run.env or {}).get("parallel") or {}
    try:
        cfg = validate(with_defaults(ev.run.config), {}, str(ev.paths.config))
        dims = ParallelDims(layout["dp_replicate"], layout["dp_shard"], layout["tp"], layout["pp"],
                            cp=layout.get("cp", 1))
    except (TrainbookError, KeyError, TypeError):
        return []
    return compression_remedies(dims, PlanInputs(cfg.model, cfg.train, cfg.parallel, cfg.precision.dtype, cfg.lora))


def _bound(shares: dict[str, float], records: list[dict], evidence: list[str],
           remedies: Callable[[], list[str]]) -> Finding | None:
    over = [(shares[k] / limit, k) for k, limit in (("data", DATA_SHARE), ("grad_sync", COMM_SHARE),
                                                   ("checkpoint", CHECKPOINT_SHARE)) if shares[k] >= limit]
    if not over:
        return None
    _, key = max(over)
    worst = max(records, key=lambda r: float(r["phases"][key]) / r["step_time_s"])
    seconds = float(worst["phases"][key])
    lines = [f"{_DESCRIPTIONS[key]}: {shares[key]:.0%} of the run's step time (threshold "
             f"{dict(data=DATA_SHARE, grad_sync=COMM_SHARE, checkpoint=CHECKPOINT_SHARE)[key]:.0%})",
             f"worst: step {worst['step']}, {seconds:.3f} s of {worst['step_time_s']:.3f} s "
             f"({seconds / worst['step_time_s']:.0%})", *evidence]
    advice = _NEXT[key]
    if key == "grad_sync" and (compress := remedies()):
        advice += "; or send fewer bytes: " + "; ".join(compress)
    return Finding(f"{_BOUND_NAMES[key]}-bound", f"{_DESCRIPTIONS[key]} {shares[key]:.0%} of step time",
                   lines, advice)


def straggler(records: list[dict]) -> Finding | None:
    """One rank waits for its data much longer than the others, in most logged steps."""
    spreads = []
    for r in records:
        wait = r["ranks"]["data_wait_s"] if r.get("ranks") is not None else None  # distributed runs only
        if wait:
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
    device = str(ev.run.env["device"]) if ev.run.env else ""  # keys checked by read_evidence
    profiled = ev.run.config["train"]["profile_phases"]
    if device and not device.startswith("cpu") and not profiled:
        return [f"on {device} without train.profile_phases the phases are host-side: device work shows where the "
                "host waits (often grad_sync); rerun with train.profile_phases=true before trusting the shares"]
    return []


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
