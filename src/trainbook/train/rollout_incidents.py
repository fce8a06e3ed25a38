"""A GRPO step's rollout kept as evidence, `incidents/step-N/rollout-dp<R>.json`: its prompts,
completions, each reward function's scores, the rewards and the advantages, with why it was kept.

- A reward function failed on it (raised, killed its worker, overran its time): every rank it
  failed on writes its share, with `errors`, and rank 0 says so in one line.
- An RL alert (reward or entropy collapse, KL blow-up, groups all alike; monitor/alerts.py)
  names its step: rank 0, which judges the alerts, writes its share, with `alerts` (the rule and
  the alert's line). The rollout of the step an alert names is the one the objective last
  sampled: alerts are judged on the step's own report.

Both on one step make one file holding both lists. `trainbook doctor` cites these files.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from trainbook.atomic import atomic_write_json
from trainbook.monitor.report import Alert
from trainbook.monitor.sinks import Sink
from trainbook.parallel.runtime import Runtime
from trainbook.runs import RunPaths

RL_RULES = ("reward_collapse", "entropy_collapse", "kl_blowup", "zero_std_groups")


class RolloutIncidents(Sink):
    def __init__(self, paths: RunPaths, rt: Runtime, say: Callable[[str], None]):
        self.paths, self.rt, self.say = paths, rt, say
        self.rollout: Callable[[], dict] = dict  # the objective's last rollout, once it exists

    def reward_error(self, step: int, record: dict) -> None:
        """The objective's `on_incident`: a reward function failed on this rank's share of the
        rollout of `step`."""
        path = self._keep(step, record, "errors", record["errors"])
        if self.rt.dp_rank == 0:
            self.say(f"{record['errors'][0]}; its rewards for this rollout are unknown and the run goes on "
                         f"({self.paths.name(path)})")

    def on_alert(self, alert: Alert) -> None:
        record = self.rollout()
        if alert.rule in RL_RULES and record:
            self._keep(alert.step, record, "alerts", [{"rule": alert.rule, "message": alert.message}])

    def _keep(self, step: int, record: dict, key: str, items: list):
        path = self.paths.incidents / f"step-{step}" / f"rollout-dp{self.rt.dp_rank}.json"
        kept = json.loads(path.read_text()) if path.exists() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**record, "dp_rank": self.rt.dp_rank, "errors": kept.get("errors", []),
                                 "alerts": kept.get("alerts", []), key: kept.get(key, []) + items})
        return path
