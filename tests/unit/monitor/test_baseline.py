import math
from pathlib import Path

import pytest

from trainbook.errors import TrainbookError
from trainbook.monitor.archive import RunRecord
from trainbook.monitor.baseline import (
    PointCheck, check_baseline, environment, environment_differences, judge, make_baseline,
)

ENV = {"python": "3.11.7", "torch": "2.13.0+cpu", "torch_threads": 2, "cuda": None, "device": "cpu",
       "devices": ["Intel(R) Xeon(R) Processor"], "world_size": 1, "parallel": {"tp": 1},
       "host": "vm", "time": 1.0, "packages": {"trainbook": "0.1.0", "numpy": "2.4.6"}}


def _run(losses: dict[int, float], vals: dict[int, float], env=ENV) -> RunRecord:
    train = [{"step": s, "loss": v, "grad_norm": 0.5, "tokens": 100 * s, "tokens_per_s": 1000.0 + s,
              "mem_peak_bytes": 2**20} for s, v in sorted(losses.items())]
    return RunRecord(Path("run"), {"train": {"max_steps": max(losses)}}, env=env, train=train,
                     evals=[{"step": s, "val_loss": v} for s, v in sorted(vals.items())])


def test_the_environment_leaves_out_host_time_and_trainbook_itself():
    env = environment(ENV)
    assert "host" not in env and "time" not in env and env["packages"] == {"numpy": "2.4.6"}
    other = environment(ENV | {"torch": "2.12.0", "packages": {"numpy": "2.4.6", "tokenizers": "0.20"}})
    assert environment_differences(other, env) == ["tokenizers 0.20 (baseline absent)", "torch 2.12.0 (baseline 2.13.0+cpu)"]


def test_bands_are_k_sample_sds_with_a_floor_and_judging_is_exact_or_banded():
    runs = [_run({10: 4.0 + d, 20: 3.0 + d}, {20: 3.5 + d}) for d in (0.0, 0.1, -0.1)]
    base = make_baseline(runs, [1, 2, 3], k=2.0, floor=0.01, recipe="r.toml", command="", config={})
    p10 = base["points"]["loss"][0]
    assert p10["mean"] == pytest.approx(4.0) and p10["sd"] == pytest.approx(0.1)
    assert (p10["lo"], p10["hi"]) == pytest.approx((3.8, 4.2))
    assert base["seed0"]["loss"] == [[10, 4.0], [20, 3.0]]
    same = judge(_run({10: 4.0, 20: 3.0}, {20: 3.5}), base, exact=True, last_step=20)
    assert all(c.ok for c in same) and {c.metric for c in same} == {"loss", "val_loss", "grad_norm"}
    nudged = judge(_run({10: 4.0 + 1e-7, 20: 3.0}, {20: 3.5}), base, exact=True, last_step=20)
    assert [(c.step, c.metric) for c in nudged if not c.ok] == [(10, "loss")]
    assert "not bit-for-bit equal" in next(c for c in nudged if not c.ok).why()
    banded = judge(_run({10: 4.15, 20: 3.5}, {20: 3.45}), base, exact=False, last_step=20)
    assert [(c.step, c.metric) for c in banded if not c.ok] == [(20, "loss")]
    assert judge(_run({10: 4.0}, {}), base, exact=False, last_step=10)[0].ok  # a prefix: only step 10
    # The floor: seeds that agree to the bit still get a band of 1% of the mean.
    flat = make_baseline([_run({10: 2.0}, {}), _run({10: 2.0}, {})], [1, 2], 3.0, 0.01, "r", "", {})
    assert flat["points"]["loss"][0]["hi"] == pytest.approx(2.02)


def test_a_missing_point_or_nan_fails():
    check = PointCheck(10, "loss", None, 4.0, 3.9, 4.1, 0.05, exact=False)
    assert not check.ok and check.why() == "not logged by this run"
    assert not PointCheck(10, "loss", math.nan, 4.0, 3.9, 4.1, 0.05, exact=False).ok


def test_a_baseline_file_is_checked_before_it_is_used():
    with pytest.raises(TrainbookError, match="not a trainbook baseline"):
        check_baseline([], "b.json")
    with pytest.raises(TrainbookError, match="points.loss\\[0\\]"):
        check_baseline({"format": 1, "seeds": [1], "k": 3, "seed0": {}, "environment": {}, "config": {},
                        "points": {"loss": [{"step": 1, "mean": "x"}]}}, "b.json")
