"""The global sample order of a training mixture: global sample g -> (source, sample), a pure function.

Every source's stream is cut into samples of seq_len + 1 tokens (see samples.py); source s has
N_s of them and a weight w_s, so its share is p_s = w_s / sum(w). The order of the whole run is
fixed by (weights, N_s, seed) alone, and any global sample g is located in O(1), vectorised, with
no replay from 0:

1. Period. The shares become integer counts c_s per period of P global samples (sum c_s = P).
   Exact when the shares are rationals with small denominators (1:1:2 -> P = 4, c = 1, 1, 2;
   0.7:0.3 -> P = 10); otherwise P = 65536 with largest-remainder rounding, each share then off
   by less than 1/P, and every source gets at least one slot per period.

2. Interleave (stride scheduling). Inside a period the k-th of the c_s slots of source s gets the
   virtual time (k + 1/2) / c_s, and the P slots are laid out in increasing time (ties: recipe
   order). Computed once: `slot_source[r]` and `slot_rank[r]` (k) for r < P. Then, with
   q, r = divmod(g, P):

       source(g) = s = slot_source[r]          local(g) = q * c_s + slot_rank[r]

   `local(g)` counts the samples of s before g: the source's own running index. Any n consecutive
   global samples hold n * p_s samples of s to within about one (plus n / P rounding).

3. Epochs. Local index j of source s is in the source's epoch e = j // N_s, at position j % N_s of
   that epoch's permutation of its N_s samples, drawn by numpy's PCG64 from the seed sequence
   (seed, crc32(source name), e). A source that runs out is re-epoched with a new permutation
   while the others go on where they are; within one epoch of a source no sample repeats.

Data parallelism and resumption sit on top of this (loader.py): a position is just the count of
global samples consumed, whatever the number of ranks that consumed them.
"""

from __future__ import annotations

import math
import zlib
from fractions import Fraction

import numpy as np

MAX_PERIOD = 1 << 16


def period_counts(weights: list[float], max_period: int = MAX_PERIOD) -> np.ndarray:
    """Integer slots per period for each weight: (S,) int64, summing to the period P."""
    total = math.fsum(weights)
    shares = [w / total for w in weights]
    fractions = [Fraction(p).limit_denominator(1000) for p in shares]
    if sum(fractions) == 1 and all(abs(float(f) - p) <= 1e-9 * p for f, p in zip(fractions, shares)):
        period = math.lcm(*(f.denominator for f in fractions))
        if period <= max_period:
            return np.array([int(f * period) for f in fractions], dtype=np.int64)
    # Largest remainder: floor, then hand the missing slots to the largest fractional parts.
    raw = np.array(shares) * max_period
    counts = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[: max_period - counts.sum()]] += 1
    for s in np.flatnonzero(counts == 0):  # a tiny weight still gets a slot
        counts[s] = 1
        counts[np.argmax(counts)] -= 1
    return counts


def interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stride-scheduled slots of one period: (slot_source, slot_rank), each (P,) int64."""
    source = np.repeat(np.arange(len(counts)), counts)  # (P,)
    rank = np.concatenate([np.arange(c) for c in counts])  # (P,)
    # (2k + 1) / (2 c): equal rationals divide to equal floats, so ties are exact ties.
    times = (2 * rank + 1) / (2 * counts[source])
    slots = np.lexsort((source, times))  # by time, then recipe order
    return source[slots], rank[slots]


class MixtureOrder:
    """Global sample index -> (source index, sample id within that source), for a fixed seed."""

    def __init__(self, names: list[str], weights: list[float], samples: list[int], seed: int):
        assert len(names) == len(weights) == len(samples) > 0
        assert all(n > 0 for n in samples) and all(w > 0 for w in weights)
        self.names = list(names)
        self.weights = np.array(weights, dtype=np.float64)
        self.samples = np.array(samples, dtype=np.int64)  # N_s
        self.seed = seed
        self.counts = period_counts(list(weights))  # c_s
        self.period = int(self.counts.sum())  # P
        self.slot_source, self.slot_rank = interleave(self.counts)
        # slots_of[s]: the slots r < P that belong to s, ascending (for counting).
        self._slots_of = [np.flatnonzero(self.slot_source == s) for s in range(len(names))]
        self._perms: dict[tuple[int, int], np.ndarray] = {}  # (source, epoch) -> permutation

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global indices g (any shape) -> (source index, local index within the source)."""
        q, r = np.divmod(np.asarray(g, dtype=np.int64), self.period)
        source = self.slot_source[r]
        return source, q * self.counts[source] + self.slot_rank[r]

    def sample_ids(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global indices g (1-D) -> (source index, sample id within the source's stream)."""
        source, local = self.locate(g)
        epoch, position = np.divmod(local, self.samples[source])
        ids = np.empty_like(local)
        # One fancy-index per (source, epoch) present: a batch touches at most a few.
        for s, e in set(zip(source.tolist(), epoch.tolist())):
            rows = (source == s) & (epoch == e)
            ids[rows] = self.permutation(s, e)[position[rows]]
        return source, ids

    def consumed_per_source(self, n: int) -> np.ndarray:
        """Samples of each source among global samples [0, n): (S,) int64."""
        q, r = divmod(int(n), self.period)
        return np.array(
            [q * c + int(np.searchsorted(slots, r)) for c, slots in zip(self.counts, self._slots_of)],
            dtype=np.int64,
        )

    def epochs_started(self, n: int) -> np.ndarray:
        """Per source, the epoch of its last sample among global samples [0, n) (-1: none yet)."""
        return (self.consumed_per_source(n) - 1) // self.samples

    def permutation(self, source: int, epoch: int) -> np.ndarray:
        """The order of source `source`'s samples in its epoch `epoch` (cached, a few per source)."""
        key = (source, epoch)
        perm = self._perms.get(key)
        if perm is None:
            name_hash = zlib.crc32(self.names[source].encode("utf-8"))
            seq = np.random.SeedSequence([self.seed % (1 << 64), name_hash, epoch])
            perm = np.random.Generator(np.random.PCG64(seq)).permutation(int(self.samples[source]))
            # Keep two epochs per source (a batch may straddle one boundary): drop the oldest.
            mine = [k for k in self._perms if k[0] == source]
            for old in mine[: max(0, len(mine) - 1)]:
                del self._perms[old]
            self._perms[key] = perm
        return perm
