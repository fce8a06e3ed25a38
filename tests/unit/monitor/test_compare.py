"""Who is ahead, by how much, where (monitor/compare.py); the charts (monitor/svg.py)."""

import re

import pytest

from tests.unit.monitor.test_archive import make_run
from trainbook.monitor.archive import load_run
from trainbook.monitor.compare import compare_text, config_differences, run_labels, verdicts
from trainbook.monitor.html import compare_page, report_page


def test_differences_and_the_run_ahead_at_equal_steps(tmp_path):
    slow = load_run(make_run(tmp_path / "a", lr=1e-3, train_steps=(2, 4, 6)))
    fast = load_run(make_run(tmp_path / "b", lr=2e-3, train_steps=(2, 4)))
    assert config_differences([slow, fast]) == {"optim.lr": [1e-3, 2e-3]}
    by_metric = {v.metric: v for v in verdicts([slow, fast])}
    loss = by_metric["loss"]
    assert loss.basis == "step 4"  # the last step both reached
    assert loss.values == [pytest.approx(5.6), pytest.approx(5.2)] and loss.ahead == 1
    assert loss.by == pytest.approx(0.4) and loss.by_relative == pytest.approx(0.4 / 5.6)
    assert by_metric["tokens_per_s"].ahead is None  # the same median over common steps: a tie
    assert "loss_tokens" not in by_metric and len([v for v in verdicts([slow, fast]) if v.metric == "loss"]) == 1


def test_equal_tokens_when_batches_differ(tmp_path):
    small = load_run(make_run(tmp_path / "a", lr=1e-3, train_steps=(2, 4, 6, 8), tokens_per_step=256, max_steps=8))
    big = load_run(make_run(tmp_path / "b", lr=1e-3, train_steps=(2, 4), tokens_per_step=512))
    loss = [v for v in verdicts([small, big]) if v.metric == "loss"]
    assert [v.basis for v in loss] == ["step 4", "2.05k tokens"]
    # At 2048 tokens: the small-batch run is at step 8 (loss 5.2), the big one at step 4 (5.6).
    assert loss[1].values == [pytest.approx(5.2), pytest.approx(5.6)] and loss[1].ahead == 0


def test_labels_are_distinct(tmp_path):
    a = load_run(make_run(tmp_path / "x" / "run"))
    b = load_run(make_run(tmp_path / "y" / "run"))
    assert run_labels([a, b]) == ["x/run", "y/run"]
    text = compare_text([a, b], run_labels([a, b]), "c.html")
    assert "config: no differences" in text and "html: c.html" in text


def test_pages_are_self_contained_and_count_their_series(tmp_path):
    a = load_run(make_run(tmp_path / "a", lr=1e-3, events=[{"kind": "checkpoint", "step": 4}]))
    b = load_run(make_run(tmp_path / "b", lr=2e-3))
    for page in (report_page(a), compare_page([a, b])):
        assert not re.search(r"""(src|href)\s*=|<script|@import|url\(""", page)  # loads nothing
        for svg in re.findall(r"<svg class=\"chart.*?</svg>", page, re.S):
            declared = int(re.search(r'data-series="(\d+)"', svg).group(1))
            assert svg.count('class="series"') == declared or 'class="cell"' in svg
    assert 'id="no-layer-stats"' in report_page(a)
    assert 'class="event event-checkpoint"' in report_page(a)
