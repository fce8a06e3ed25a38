"""Where a training batch came from: each row's source, sample and token span, and the document
it was cut from (NaN and loss-spike incidents, diagnose/triage.py).

A row of the micro-batch read at global sample `base` by data-parallel rank r is global sample
`base + r * B + j` (data/loader.py); the mixture order maps it to (source, sample id), and
sample i of a source is tokens [i*T, i*T + T + 1) of its stream. A row's documents are the spans
between the EOS tokens around it (prepare writes every document followed by one EOS).
"""

from __future__ import annotations

import numpy as np

from trainbook.data.loader import TrainLoader
from trainbook.data.shards import TokenStream

DOCUMENT_LIMIT = 4096
"""Tokens read on either side of a row when looking for its documents' ends."""


def batch_rows(loader: TrainLoader, base: int) -> list[tuple[str, int, int]]:
    """This rank's rows of the micro-batch read at global sample `base`: (source, sample id,
    first token's offset in the source's stream) each."""
    lo = base + loader.rank * loader.micro_batch_size
    source, ids = loader.order.sample_ids(np.arange(lo, lo + loader.micro_batch_size))  # (B,) each
    return [(loader.names[s], int(i), int(i) * loader.seq_len) for s, i in zip(source.tolist(), ids.tolist())]


def document_span(stream: TokenStream, start: int, end: int, eos_id: int,
                  limit: int = DOCUMENT_LIMIT) -> tuple[int, int, bool]:
    """The documents tokens [start, end) of `stream` belong to: (first token, one past the last
    token, cut) where the span starts after the EOS before `start` and ends at the EOS at or
    after `end - 1` (inclusive), each looked for at most `limit` tokens away (`cut`: not found)."""
    lo = max(0, start - limit)
    before = stream.take(np.array([lo]), start - lo)[0] if start > lo else np.empty(0, dtype=np.int64)
    eos_before = np.flatnonzero(before == eos_id)
    first = lo + int(eos_before[-1]) + 1 if len(eos_before) else lo
    hi = min(len(stream), end + limit)
    after = stream.take(np.array([end - 1]), hi - end + 1)[0] if hi > end - 1 else np.empty(0, dtype=np.int64)
    eos_after = np.flatnonzero(after == eos_id)
    last = end - 1 + int(eos_after[0]) + 1 if len(eos_after) else hi
    cut = (not len(eos_before) and lo > 0) or (not len(eos_after) and hi < len(stream))
    return first, last, bool(cut)
