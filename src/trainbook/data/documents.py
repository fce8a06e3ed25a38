"""The document stream of a recipe: read -> clean -> deduplicate -> assign to train or val.

Streams with bounded memory (one document at a time, plus the deduplication index), and is
deterministic: iterating twice gives the same documents in the same order, which is how
`prepare` makes its two passes (train a tokenizer, then tokenize) without holding the corpus.

The split is by whole document: a document goes to validation when u(seed, text) <
val_fraction, where u is its sha256 read as a number in [0, 1). That needs no second pass and
no per-document memory, does not depend on file order, and keeps a document in the same split
when other documents are added. So that a small corpus still gets one validation document,
the train document with the smallest u is held back until a validation document appears;
if none does, it becomes the validation document.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from trainbook.config.data import DataConfig, SourceConfig
from trainbook.data.chat import CHAT_FORMATS
from trainbook.data.clean import Cleaner
from trainbook.data.dedup import Deduplicator
from trainbook.data.sources import SourceStats, iter_documents, resolve_paths
from trainbook.errors import TrainbookError


class Document(NamedTuple):
    source: int
    """Index of the source in `data.sources`."""
    text: str
    is_val: bool


@dataclass
class SourceReport:
    """What happened to one source's documents (filled while the stream is iterated)."""

    name: str
    read: SourceStats = field(default_factory=SourceStats)
    cleaning: dict[str, int] = field(default_factory=dict)
    duplicates: dict[str, int] = field(default_factory=lambda: {"exact": 0, "near": 0})
    documents_out: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})

    def as_dict(self) -> dict:
        return {
            "name": self.name, "read": vars(self.read), "cleaning": dict(self.cleaning),
            "duplicates": dict(self.duplicates), "documents_out": dict(self.documents_out),
        }


def unit_hash(seed: int, text: str) -> float:
    """A document's place in [0, 1), from its text and the seed alone."""
    digest = hashlib.sha256(f"{seed}\0{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class DocumentStream:
    def __init__(self, data: DataConfig, seed: int):
        self.data = data
        self.seed = seed
        self.reports: list[SourceReport] = []

    def __iter__(self) -> Iterator[Document]:
        data = self.data
        self.reports = [SourceReport(s.name) for s in data.sources]
        dedup = Deduplicator(data.dedup)
        held: tuple[float, Document] | None = None  # the smallest-u train document so far
        seen_val = False
        n_documents = 0
        for doc in self._cleaned(dedup):
            n_documents += 1
            u = unit_hash(self.seed, doc.text)
            if u < data.val_fraction:
                seen_val = True
                if held is not None:  # no longer needed as a stand-in: release it in order
                    yield self._count(held[1])
                    held = None
                yield self._count(doc._replace(is_val=True))
            elif data.val_fraction > 0 and not seen_val and (held is None or u < held[0]):
                if held is not None:
                    yield self._count(held[1])
                held = (u, doc)
            else:
                yield self._count(doc)
        if held is not None:
            stand_in = not seen_val and n_documents >= 2
            yield self._count(held[1]._replace(is_val=stand_in))

    def _cleaned(self, dedup: Deduplicator) -> Iterator[Document]:
        for i, source in enumerate(self.data.sources):
            report = self.reports[i]
            cleaner = Cleaner(self.data.clean)
            produced = 0
            # Conversations are used as written (a canonical JSON record: data/chat.py).
            chat = source.format in CHAT_FORMATS
            for text in iter_documents(source, where=f"data.sources[{i}]", stats=report.read):
                text = text if chat else cleaner(text)
                if text is None:
                    continue
                duplicate = dedup.check(text, source.name)
                if duplicate is not None:
                    report.duplicates[duplicate] += 1
                    continue
                produced += 1
                yield Document(i, text, False)
            report.cleaning = dict(cleaner.counts)
            if produced == 0:
                raise TrainbookError(
                    f"source '{source.name}' has no documents left in {_files(source, i)} "
                    f"(read {report.read.documents}, after cleaning and deduplication: 0)",
                    where=f"data.sources[{i}]",
                )

    def _count(self, doc: Document) -> Document:
        self.reports[doc.source].documents_out["val" if doc.is_val else "train"] += 1
        return doc


def _files(source: SourceConfig, i: int, most: int = 3) -> str:
    """The files a source read, for an error message: `'a.txt'` or `3 files ('a', 'b', 'c')`."""
    paths = resolve_paths(source.paths, where=f"data.sources[{i}].paths")
    shown = ", ".join(f"'{p}'" for p in paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")
    return shown if len(paths) == 1 else f"{len(paths)} files ({shown})"
