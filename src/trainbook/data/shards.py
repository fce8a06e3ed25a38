"""Token shards: flat binary arrays of token ids, each with a small JSON index beside it.

    train-00000.bin    token ids, little-endian uint16 (vocab <= 65535) or uint32, no header
    train-00000.json   {"format", "dtype", "tokens", "documents", "doc_starts", "sha256"}

A split is a sequence of shards; read in order they are one token stream (`TokenStream`).
`doc_starts` are the offsets, in this shard, of the documents that begin in it; a shard is cut
at exactly `max_tokens`, so its first tokens may continue a document from the previous shard.
Shards know nothing of EOS: prepare writes each document followed by its EOS (see samples.py).

Files are written atomically (temp file in the same directory, fsync, rename), the index after
the .bin, so an index always describes a complete .bin. Reading is a read-only `np.memmap`: a
loader touches only the pages its batches use, whatever the corpus size.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from trainbook.atomic import atomic_write_bytes, atomic_write_json
from trainbook.errors import TrainbookError

SHARD_FORMAT = "trainbook-shard/1"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype for the ids, little-endian so files move between machines."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def index_path(bin_path: Path) -> Path:
    return Path(bin_path).with_suffix(".json")


def write_shard(bin_path: Path, tokens: np.ndarray, doc_starts: np.ndarray, meta: dict | None = None) -> dict:
    """Write one shard (.bin, then its .json index) and return the index.

    `meta` (e.g. the source name and the tokenizer's hash) is recorded in the index as given.
    """
    tokens = np.ascontiguousarray(tokens)
    data = memoryview(tokens).cast("B")
    index = {
        "format": SHARD_FORMAT,
        "dtype": tokens.dtype.name,  # "uint16" / "uint32"; always little-endian on disk
        "tokens": int(tokens.size),
        "documents": int(len(doc_starts)),
        "doc_starts": [int(s) for s in doc_starts],
        "sha256": hashlib.sha256(data).hexdigest(),
        **(meta or {}),
    }
    atomic_write_bytes(Path(bin_path), data)
    atomic_write_json(index_path(bin_path), index)
    return index


def read_index(bin_path: Path) -> dict:
    path = index_path(bin_path)
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TrainbookError(f"unreadable shard index: {e}", where=str(path)) from e
    if index.get("format") != SHARD_FORMAT:
        raise TrainbookError(f"not a {SHARD_FORMAT} index", where=str(path))
    return index


def read_shard(bin_path: Path) -> np.ndarray:
    """The shard's tokens as a read-only memory map (shape: (tokens,))."""
    index = read_index(bin_path)
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    expected = index["tokens"] * dtype.itemsize
    actual = os.path.getsize(bin_path) if os.path.exists(bin_path) else None
    if actual != expected:
        raise TrainbookError(
            f"shard has {actual} bytes, its index says {expected} (truncated or replaced?)",
            where=str(bin_path),
        )
    if expected == 0:  # mmap cannot map an empty file
        return np.empty(0, dtype=dtype)
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(index["tokens"],))


def verify_shard(bin_path: Path) -> None:
    """Raise if the .bin's bytes do not hash to the sha256 its index recorded."""
    index = read_index(bin_path)
    digest = hashlib.sha256()
    with open(bin_path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != index["sha256"]:
        raise TrainbookError("shard checksum mismatch (corrupted file)", where=str(bin_path))


class ShardWriter:
    """Collect documents' tokens and write them as shards of at most `max_tokens` tokens.

    Holds at most about one shard in memory, so a streaming prepare can feed it document by
    document. `close()` writes the last, partial shard and returns the shard file names.
    """

    def __init__(self, directory: Path, split: str, dtype: np.dtype, max_tokens: int, meta: dict | None = None):
        self.directory = Path(directory)
        self.split = split
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.meta = meta
        self.names: list[str] = []
        self.mask_names: list[str] | None = None  # the mask shards beside these (chat data), set by prepare
        self.documents = 0
        self.tokens = 0
        self._pending: list[np.ndarray] = []
        self._pending_starts: list[int] = []  # doc starts, relative to the pending buffer
        self._pending_tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        """Append one document's tokens (with its EOS, when the caller packs with EOS)."""
        self._pending_starts.append(self._pending_tokens)
        # A copy: the caller's array may be a view into a much larger buffer, which a view kept
        # here would keep alive until this split's next flush (for a small split: to the end).
        self._pending.append(np.array(tokens, dtype=self.dtype))
        self._pending_tokens += len(tokens)
        self.documents += 1
        self.tokens += len(tokens)
        if self._pending_tokens >= self.max_tokens:
            self._flush(final=False)

    def close(self) -> list[str]:
        if self._pending_tokens:
            self._flush(final=True)
        return self.names

    def _flush(self, final: bool) -> None:
        # One concatenation per flush, then every full shard in it: a document larger than
        # many shards is cut in one pass.
        buf = np.concatenate(self._pending)
        starts = np.asarray(self._pending_starts, dtype=np.int64)
        n_write = len(buf) if final else len(buf) - len(buf) % self.max_tokens
        for lo in range(0, n_write, self.max_tokens):
            hi = min(lo + self.max_tokens, n_write)
            name = f"{self.split}-{len(self.names):05d}.bin"
            write_shard(
                self.directory / name, buf[lo:hi], starts[(starts >= lo) & (starts < hi)] - lo, self.meta
            )
            self.names.append(name)
        tail = buf[n_write:].copy()  # not a view: the flushed part of buf can be freed
        self._pending = [tail] if len(tail) else []
        self._pending_starts = [int(s) - n_write for s in starts if s >= n_write]
        self._pending_tokens = len(tail)


class TokenStream:
    """The shards of one split read as one read-only token array, without copying it."""

    def __init__(self, paths: list[Path]):
        self.paths = [Path(p) for p in paths]
        self._arrays = [read_shard(p) for p in self.paths]
        self._bounds = np.cumsum([0] + [len(a) for a in self._arrays])  # shard k: [b[k], b[k+1])
        self.dtype = self._arrays[0].dtype if self._arrays else np.dtype("<u2")
        self._documents: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self._bounds[-1])

    def documents(self) -> tuple[np.ndarray, np.ndarray]:
        """(first token, length) of every document that begins in the stream, in order, each
        (D,) int64, from the shards' `doc_starts` (a document may run on into the next shard).
        Read from the indexes once, on first use (pad packing's samples are documents)."""
        if self._documents is None:
            starts = np.concatenate([np.zeros(0, dtype=np.int64)] + [
                self._bounds[k] + np.asarray(read_index(p)["doc_starts"], dtype=np.int64)
                for k, p in enumerate(self.paths)])
            self._documents = (starts, np.diff(np.append(starts, len(self))))
        return self._documents

    def take(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows `stream[s : s + length]` for each s in `starts`: shape (len(starts), length)."""
        positions = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length)  # (N, L)
        return self.gather(positions)

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """The tokens at `positions` (any shape, int64), in that shape."""
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"token positions outside the stream of {len(self)} tokens")
        if len(self._arrays) == 1:  # the common case: one fancy-index read from the map
            return self._arrays[0][positions]
        shard = np.searchsorted(self._bounds, positions, side="right") - 1
        out = np.empty(positions.shape, dtype=self.dtype)
        for k in np.unique(shard):
            rows = shard == k
            out[rows] = self._arrays[k][positions[rows] - self._bounds[k]]
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `stream[start:stop]` as an array (a copy)."""
        return self.take(np.array([start]), stop - start)[0]
