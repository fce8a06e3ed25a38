"""The straggler rule on hand-made per-rank figures: what a real 2-rank run cannot show (four
ranks and the robust z, compute and communication as the cause, a streak that breaks).
tests/e2e/test_stragglers.py proves the rule on a real slow rank."""

from __future__ import annotations

import dataclasses

from trainbook.config import AlertsConfig
from trainbook.monitor import RankTimes, RunInfo, StepReport
from trainbook.monitor.alerts import AlertRules
from trainbook.runs import RunPaths


def rules(**cfg) -> tuple[AlertRules, list]:
    fired = []
    info = RunInfo(RunPaths.of("."), "unit", 0, 4, 100)
    return AlertRules(AlertsConfig(rules=["straggler"], **cfg), info, fired.append), fired


def report(step: int, late: int | None, *, wait_data: float = 0.0, wait_compute: float = 0.0,
           data: float = 0.01, compute: float = 0.4, comm: float = 0.05, n: int = 4) -> StepReport:
    """A 1 s step of `n` ranks; the others wait `wait_data`/`wait_compute` at the probes for rank
    `late`, whose data, compute and communication take `data`, `compute`, `comm` seconds."""
    def per_rank(mine: float, others: float) -> list[float]:
        return [mine if r == late else others for r in range(n)]

    times = RankTimes(
        hosts=[f"node{r}" for r in range(n)], step_time_s=[1.0] * n, data_s=per_rank(data, 0.01),
        compute_s=per_rank(compute, 0.4), comm_s=per_rank(comm, 0.05),
        wait_data_s=per_rank(0.0, wait_data), wait_compute_s=per_rank(0.0, wait_compute))
    return StepReport(step=step, tokens=0, loss=3.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0, step_time_s=1.0,
                      rank_times=times)


def test_third_late_interval_in_a_row_names_the_rank_its_host_and_compute():
    alerts, fired = rules()
    for step in (1, 2, 3):
        alerts.on_step(report(step, 2, wait_compute=0.3, compute=0.7))
    assert [(a.rule, a.step) for a in fired] == [("straggler", 3)]
    assert fired[0].message == ("rank 2 (host node2) is the straggler for 3 probed intervals: the others wait "
                                "0.300 s a step for it; its time goes to compute (forward + backward + optimizer "
                                "0.700 s vs median 0.400 s)")
    assert fired[0].value == 0.3 and fired[0].threshold == 0.2  # straggler_frac x the 1 s step


def test_late_in_communication_and_fired_again_without_a_repeat_limit():
    alerts, fired = rules(repeat_after_s=0)
    for step in (1, 2, 3, 4):
        alerts.on_step(report(step, 1, wait_data=0.3, comm=0.4))
    assert [a.step for a in fired] == [3, 4]
    assert "for 4 probed intervals" in fired[1].message
    assert fired[1].message.endswith("its time goes to communication (exposed communication 0.400 s vs median "
                                     "0.050 s)")


def test_no_alert_below_the_limit_when_the_rank_changes_or_half_the_ranks_are_slow():
    alerts, fired = rules()
    for step in (1, 2, 3):  # 0.15 s of a 1 s step: under straggler_frac 0.2
        alerts.on_step(report(step, 3, wait_data=0.15, data=0.16))
    for step, late in zip((4, 5, 6, 7, 8), (1, 1, 2, 1, 1)):  # never 3 in a row for one rank
        alerts.on_step(report(step, late, wait_data=0.5, data=0.51))
    # Ranks 2 and 3 both slow: each is 0.3 s late, but no more than the other half is early (robust z 0.7).
    slow_pair = RankTimes(["a", "b", "c", "d"], [1.0] * 4, [0.01, 0.01, 0.31, 0.31], [0.4] * 4, [0.05] * 4,
                          [0.3, 0.3, 0.0, 0.0], [0.0] * 4)
    for step in (9, 10, 11):
        alerts.on_step(dataclasses.replace(report(step, None), rank_times=slow_pair))
    assert fired == []
    alerts.on_step(report(12, 1, wait_data=0.5, data=0.51))  # rank 1's streak (7, 8) ended at step 9
    assert fired == []
