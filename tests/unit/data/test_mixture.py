"""The global sample order: period counts, stride interleave, epochs, and its pure-function form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainbook.data.mixture import MAX_PERIOD, MixtureOrder, interleave, period_counts


@pytest.mark.parametrize(
    ("weights", "counts"),
    [([1.0], [1]), ([1, 1, 2], [1, 1, 2]), ([0.7, 0.3], [7, 3]), ([2.0, 6.0], [1, 3]),
     ([0.5, 0.3, 0.2], [5, 3, 2])],
)
def test_rational_weights_give_an_exact_short_period(weights, counts):
    assert period_counts(weights).tolist() == counts


def test_irrational_weights_round_to_the_long_period():
    weights = [1.0, math.sqrt(2), math.pi, 1e-9]  # the last would round to 0 slots
    counts = period_counts(weights)
    assert counts.sum() == MAX_PERIOD and counts.min() >= 1
    shares = np.array(weights) / sum(weights)
    assert np.abs(counts / MAX_PERIOD - shares).max() <= 1.5 / MAX_PERIOD


def test_interleave_spreads_each_source_evenly():
    source, rank = interleave(np.array([5, 3, 2]))
    # times: a 0.1 0.3 0.5 0.7 0.9, b 1/6 0.5 5/6, c 0.25 0.75 (the tie at 0.5: recipe order)
    assert source.tolist() == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0]
    for s, c in enumerate([5, 3, 2]):
        assert rank[source == s].tolist() == list(range(c))  # each source's slots in its own order


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1.0, math.sqrt(2), math.e]])
def test_every_window_follows_the_weights(weights):
    order = MixtureOrder(["a", "b", "c"], weights, [1000, 500, 700], seed=0)
    shares = np.array(weights) / sum(weights)
    n = 50_000
    for start in [0, 12_345, 10**12 + 7]:
        source, _ = order.locate(np.arange(start, start + n))
        counts = np.bincount(source, minlength=3)
        # Within ~1 sample of the exact share, plus the rounding of shares to 1/P.
        assert np.abs(counts - n * shares).max() <= 2 + n / order.period


def test_local_index_is_the_running_count_of_the_source():
    order = MixtureOrder(["a", "b"], [1.0, math.sqrt(3)], [50, 80], seed=1)
    g = np.arange(3 * order.period + 17)
    source, local = order.locate(g)
    running = np.zeros(2, dtype=np.int64)
    expected = np.empty_like(local)
    for i, s in enumerate(source):  # the replay the closed form avoids
        expected[i] = running[s]
        running[s] += 1
    assert np.array_equal(local, expected)
    assert order.consumed_per_source(len(g)).tolist() == running.tolist()


def test_each_source_epoch_is_a_fresh_permutation():
    order = MixtureOrder(["a", "b"], [3.0, 1.0], [40, 13], seed=5)
    source, ids = order.sample_ids(np.arange(400))  # about 7 epochs of "a", 7.7 of "b"
    for s, n in enumerate([40, 13]):
        seen = ids[source == s]
        epochs = [seen[i : i + n] for i in range(0, len(seen) - n + 1, n)]
        assert len(epochs) >= 7
        for epoch in epochs:
            assert sorted(epoch.tolist()) == list(range(n))  # no repeat, none skipped
        assert any(not np.array_equal(epochs[0], e) for e in epochs[1:])
    assert order.epochs_started(400).tolist() == [(300 - 1) // 40, (100 - 1) // 13]


def test_order_depends_only_on_the_seed():
    def ids(seed, names=("a", "b")):
        return MixtureOrder(list(names), [1.0, 2.0], [100, 100], seed).sample_ids(np.arange(500))

    a, b, c = ids(0), ids(0), ids(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert np.array_equal(a[0], c[0]) and not np.array_equal(a[1], c[1])  # same mix, new shuffle


def test_far_global_indices_need_no_replay():
    order = MixtureOrder(["a", "b", "c"], [1.0, 1.0, 2.0], [10**6, 3 * 10**6, 7], seed=2)
    g = np.arange(10**15, 10**15 + 64)
    source, ids = order.sample_ids(g)
    assert ids.min() >= 0 and all(ids[source == s].max() < n for s, n in enumerate([10**6, 3 * 10**6, 7]) if (source == s).any())
    before = order.consumed_per_source(10**15)
    assert before.sum() == 10**15 and before.tolist() == [10**15 // 4, 10**15 // 4, 10**15 // 2]
