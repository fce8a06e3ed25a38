from __future__ import annotations

import random

from trainbook.config.data import DedupConfig
from trainbook.data.dedup import Deduplicator

# Made-up prose: a vocabulary large enough that unrelated documents share almost no 5-grams.
WORDS = [f"w{i}" for i in range(3000)]


def _document(seed: int, n_words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _edit(text: str, n: int, seed: int = 0) -> str:
    """`text` with `n` words, spread evenly, replaced by new ones."""
    words = text.split()
    rng = random.Random(seed)
    for i in range(n):
        words[(i * len(words)) // n + 1] = f"changed{rng.randrange(10**6)}"
    return " ".join(words)


def test_exact_duplicates_across_sources_first_occurrence_wins():
    dedup = Deduplicator(DedupConfig())
    assert dedup.check("to be or not to be", "plays") is None
    assert dedup.check("that is the question", "plays") is None
    assert dedup.check("to be or not to be", "plays") == "exact"
    assert dedup.check("that is the question", "web") == "exact"
    assert dedup.check("To be or not to be", "web") is None  # exact means exact
    assert dedup.counts == {"plays": {"exact": 1, "near": 0}, "web": {"exact": 1, "near": 0}}


def test_near_duplicates_are_caught_and_unrelated_documents_are_not():
    dedup = Deduplicator(DedupConfig(near=True, threshold=0.8))
    original = _document(1)
    assert dedup.check(original, "a") is None
    # 3 words changed in 300: 15 of the 296 5-gram shingles change, Jaccard ~ 0.90.
    assert dedup.check(_edit(original, 3), "b") == "near"
    assert dedup.check(original.upper(), "b") == "near"  # shingles are lower-cased
    assert dedup.check(_document(2), "b") is None
    # 25 words changed: Jaccard ~ 0.4, well under the threshold.
    assert dedup.check(_edit(original, 25, seed=1), "b") is None
    assert dedup.check(original, "b") == "exact"
    assert dedup.counts == {"a": {"exact": 0, "near": 0}, "b": {"exact": 1, "near": 2}}


def test_short_documents_are_one_shingle():
    dedup = Deduplicator(DedupConfig(exact=False, near=True, shingle_size=5))
    assert dedup.check("Exeunt.", "a") is None
    assert dedup.check("exeunt.", "a") == "near"
    assert dedup.check("Exit.", "a") is None


def test_decisions_are_deterministic():
    def run() -> list[str | None]:
        dedup = Deduplicator(DedupConfig(near=True, threshold=0.7, num_perm=64))
        docs = [_document(i % 7, 120) for i in range(20)]
        docs += [_edit(_document(i, 120), 1 + i % 15, seed=i) for i in range(20)]
        return [dedup.check(d, f"s{i % 3}") for i, d in enumerate(docs)]

    first = run()
    assert first == run()
    assert first.count("exact") == 13 and "near" in first and None in first
