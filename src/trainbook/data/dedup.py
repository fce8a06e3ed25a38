"""Deduplication across all sources: exact (sha256) and near (MinHash + LSH over word shingles).

The first occurrence wins, in stream order (sources in recipe order, files sorted), so the
result is the same on every run. Memory grows with the documents kept: 32 bytes each for exact
deduplication, about `num_perm * 4` bytes plus the LSH index for near deduplication.
"""

from __future__ import annotations

import hashlib

from typing import TYPE_CHECKING

import numpy as np

from trainbook.config.data import DedupConfig

if TYPE_CHECKING:  # datasketch (and scipy under it) is imported when data is prepared, not by every worker
    from datasketch import MinHash, MinHashLSH

# Fixed, so signatures (and so the decisions) are the same on every run and machine.
MINHASH_SEED = 1


class Deduplicator:
    """`check(text, source)` -> "exact" or "near" if `text` duplicates a document kept earlier
    (from any source), else None, and the document is remembered as kept.

    `counts[source]` = {"exact": n, "near": n}: the duplicates found in each source.
    """

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        self.counts: dict[str, dict[str, int]] = {}
        self._digests: set[bytes] = set()
        self._lsh: MinHashLSH | None = None
        if cfg.near:
            from datasketch import MinHash, MinHashLSH

            self._lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
            # Copied per document: permutations are drawn once, not per MinHash.
            self._empty = MinHash(num_perm=cfg.num_perm, seed=MINHASH_SEED)
            self._signatures: list[np.ndarray] = []  # by LSH key, to confirm candidates

    def check(self, text: str, source: str) -> str | None:
        counts = self.counts.setdefault(source, {"exact": 0, "near": 0})
        digest = hashlib.sha256(text.encode("utf-8")).digest() if self.cfg.exact else None
        if digest is not None and digest in self._digests:
            counts["exact"] += 1
            return "exact"
        if self._lsh is not None:
            minhash = self.minhash(text)
            if self._is_near_duplicate(minhash):
                counts["near"] += 1
                return "near"
            key = len(self._signatures)
            self._lsh.insert(key, minhash, check_duplication=False)
            self._signatures.append(minhash.hashvalues.copy())
        if digest is not None:
            self._digests.add(digest)
        return None

    def minhash(self, text: str) -> MinHash:
        """The MinHash of the document's set of lower-cased word `shingle_size`-grams."""
        words = text.lower().split()
        k = self.cfg.shingle_size
        if len(words) <= k:
            shingles = {" ".join(words).encode("utf-8")}  # shorter than a shingle: one shingle
        else:
            starts = range(len(words) - k + 1)
            shingles = {" ".join(words[i : i + k]).encode("utf-8") for i in starts}
        minhash = self._empty.copy()
        minhash.update_batch(shingles)  # order-free: a minimum over the set
        return minhash

    def _is_near_duplicate(self, minhash: MinHash) -> bool:
        """An LSH candidate counts only if its estimated Jaccard similarity reaches the threshold.

        LSH alone also returns some pairs below it (banding is a probabilistic filter); checking
        the signatures makes `threshold` mean what the recipe says, at the cost of keeping them.
        """
        for key in sorted(self._lsh.query(minhash)):
            similarity = np.count_nonzero(self._signatures[key] == minhash.hashvalues) / len(
                minhash.hashvalues
            )
            if similarity >= self.cfg.threshold:
                return True
        return False
