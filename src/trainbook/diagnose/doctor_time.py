"""`trainbook doctor`: how the time of a run went (diagnose/doctor.py runs these rules after the
failures).

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

import statistics
from collections.abc import Callable

from trainbook.diagnose.findings import Evidence, Finding
from trainbook.errors import TrainbookError

DATA_SHARE = 0.20
COMM_SHARE = 0.25
CHECKPOINT_SHARE = 0.15
STRAGGLER_SHARE = 0.20
ROLLOUT_TIMES = ("time/rollout_s", "time/reward_s", "time/reference_s")  # train/grpo.py: inside the data phase


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
