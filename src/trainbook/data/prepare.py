"""prepare: sources -> train/val split -> tokenizer -> token shards, cached by content.

    <cache_dir>/<key>/
      tokenizer.json
      train-00000.bin/.json ...   the packed train stream (doc EOS doc EOS ...), see loader.py
      val-00000.bin/.json ...
      manifest.json               written last: its presence means the directory is complete

`key` hashes everything the shards depend on: the data and tokenizer settings, the seed, the
format of what prepare writes, and every input file's path, size and content hash. Any change
gives a new directory; an unchanged recipe finds the manifest and reuses the shards without
reading a document.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from trainbook.config.schema import DataConfig, TokenizerConfig
from trainbook.atomic import atomic_write_json
from trainbook.data.shards import ShardWriter, TokenStream, token_dtype
from trainbook.data.sources import iter_documents, resolve_paths
from trainbook.data.tokenizer import Tokenizer, build_tokenizer
from trainbook.errors import TrainbookError

# Bump when prepare would write different shards for the same inputs (markdown conversion,
# split rule, packing...): old cache entries then stop matching instead of being reused.
PREPARE_FORMAT = 1
SPLITS = ("train", "val")
# Characters per encode_batch call: bounds the Python lists of ids alive at once (~100 MB).
# Long documents are cut into pieces inside encode_batch, so any batch keeps every core busy.
ENCODE_BATCH_CHARS = 4_000_000

Log = Callable[[str], None]


@dataclass(frozen=True)
class Prepared:
    dir: Path
    """The cache entry: tokenizer.json, shards, manifest.json."""
    tokenizer: Tokenizer
    train: TokenStream
    """The packed train stream (memory-mapped shards)."""
    val: TokenStream
    """The packed validation stream; empty when `val_fraction` is 0."""
    manifest: dict
    """Counts, tokenizer sha256, cache key, inputs: the contents of manifest.json."""
    cached: bool
    """True when an existing cache entry was reused (nothing was read or tokenized)."""


def prepare(
    data: DataConfig, tok: TokenizerConfig, *, seed: int, log: Log | None = None
) -> Prepared:
    """Make (or find in the cache) the tokenized train/val streams of a recipe's corpus."""
    log = log or (lambda message: None)
    if not data.sources:
        raise TrainbookError("no data sources configured", where="data.sources")
    inputs = _hash_inputs(data)
    key = cache_key(data, tok, seed=seed, inputs=inputs)
    out = Path(data.cache_dir) / key[:16]

    found = _load_cached(out, key, tok, log)
    if found is not None:
        return found

    documents = _read_documents(data)  # [(source index, text)] in source, then file order
    is_val = split_documents([text for _, text in documents], data.val_fraction, seed)
    n_val = int(is_val.sum())
    log(f"read {len(documents)} documents: {len(documents) - n_val} train, {n_val} val")

    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # a damaged entry is incomplete from now on
    # Trained on train documents only, so validation text stays unseen by every part of a run.
    train_texts = [text for (_, text), val in zip(documents, is_val, strict=True) if not val]
    if tok.kind == "train_bpe":
        log(f"training a BPE tokenizer (vocab {tok.vocab_size}) on {len(train_texts)} documents")
    tokenizer = build_tokenizer(tok, lambda: iter(train_texts))
    tokenizer.save(out / "tokenizer.json")

    log(f"tokenizing {len(documents)} documents ...")
    t0 = time.perf_counter()
    counts = _write_shards(out, documents, is_val, tokenizer, data.shard_tokens)
    log(
        f"tokenized in {time.perf_counter() - t0:.1f} s: "
        f"{counts['train'].tokens:,} train tokens, {counts['val'].tokens:,} val tokens"
    )

    manifest = _manifest(
        data, tok, seed=seed, key=key, inputs=inputs, tokenizer=tokenizer, counts=counts
    )
    atomic_write_json(out / "manifest.json", manifest)  # last: marks the entry complete
    return _open(out, tokenizer, manifest, cached=False)


def cache_key(data: DataConfig, tok: TokenizerConfig, *, seed: int, inputs: list[dict]) -> str:
    """sha256 (hex) over every input of prepare that can change what it writes."""
    tokenizer = {"kind": tok.kind, "eos_token": tok.eos_token}
    if tok.kind == "train_bpe":
        # Training results may change with the library version; a new version retrains.
        tokenizer |= {"vocab_size": tok.vocab_size, "tokenizers": tokenizers.__version__}
    else:
        if tok.path is None:
            raise TrainbookError(
                f"kind '{tok.kind}' needs a tokenizer file", where="tokenizer.path"
            )
        tokenizer |= {"path": tok.path, "sha256": _file_sha256(Path(tok.path), "tokenizer.path")}
    payload = {
        "format": PREPARE_FORMAT,
        # `weight` is left out: it steers sampling from prepared data, not what is prepared.
        "sources": [s.model_dump(exclude={"weight"}) for s in data.sources],
        "val_fraction": data.val_fraction,
        "shard_tokens": data.shard_tokens,
        "seed": seed,
        "tokenizer": tokenizer,
        "inputs": inputs,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def split_documents(texts: list[str], val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of validation documents: whole documents, never a part of one.

    n_val = round(val_fraction * n), at least 1 when val_fraction > 0 and n >= 2, and always
    leaving one train document. The val documents are those with the smallest
    sha256(seed, text): reproducible from (seed, texts) alone, whatever the library versions,
    and independent of the order the files are listed in.
    """
    n = len(texts)
    n_val = 0 if val_fraction == 0 or n < 2 else min(n - 1, max(1, round(val_fraction * n)))
    ranks = sorted(
        range(n), key=lambda i: (hashlib.sha256(f"{seed}\0{texts[i]}".encode()).digest(), i)
    )
    is_val = np.zeros(n, dtype=bool)
    is_val[ranks[:n_val]] = True
    return is_val


def _hash_inputs(data: DataConfig) -> list[dict]:
    """One record per input file: which source (index), where, how big, what content."""
    records = []
    for i, source in enumerate(data.sources):
        where = f"data.sources[{i}].paths"
        for path in resolve_paths(source.paths, where=where):
            records.append(
                {
                    "source": i,
                    "path": str(path.resolve()),
                    "bytes": path.stat().st_size,
                    "sha256": _file_sha256(path, where),
                }
            )
    return records


def _file_sha256(path: Path, where: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:
        raise TrainbookError(f"cannot read '{path}': {e.strerror or e}", where=where) from e


def _read_documents(data: DataConfig) -> list[tuple[int, str]]:
    documents = []
    for i, source in enumerate(data.sources):
        texts = list(iter_documents(source, where=f"data.sources[{i}]"))
        if not texts:
            raise TrainbookError(
                f"source '{source.name}' has no documents (every file is empty)",
                where=f"data.sources[{i}]",
            )
        documents += [(i, text) for text in texts]
    return documents


@dataclass
class _SplitCounts:
    names: list[str]
    documents: int
    tokens: int
    per_source_documents: np.ndarray  # (n_sources,)
    per_source_tokens: np.ndarray  # (n_sources,)


def _write_shards(
    out: Path,
    documents: list[tuple[int, str]],
    is_val: np.ndarray,
    tokenizer: Tokenizer,
    shard_tokens: int,
) -> dict[str, _SplitCounts]:
    """Tokenize every document once, append EOS, and stream it into its split's shards."""
    n_sources = max(source for source, _ in documents) + 1
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: ShardWriter(out, s, dtype, shard_tokens) for s in SPLITS}
    per_source = {s: np.zeros((2, n_sources), dtype=np.int64) for s in SPLITS}  # docs, tokens
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    for lo, hi in _batches(documents, ENCODE_BATCH_CHARS):
        ids = tokenizer.encode_batch([text for _, text in documents[lo:hi]])
        for (source, _), doc_ids, val in zip(documents[lo:hi], ids, is_val[lo:hi], strict=True):
            split = "val" if val else "train"
            tokens = np.concatenate([np.asarray(doc_ids, dtype=dtype), eos])  # EOS after each doc
            writers[split].add(tokens)
            per_source[split][:, source] += (1, len(tokens))
    return {
        s: _SplitCounts(writers[s].close(), writers[s].documents, writers[s].tokens, *per_source[s])
        for s in SPLITS
    }


def _batches(documents: list[tuple[int, str]], max_chars: int) -> Iterator[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of documents holding about `max_chars` characters each."""
    lo, chars = 0, 0
    for i, (_, text) in enumerate(documents):
        chars += len(text)
        if chars >= max_chars:
            yield lo, i + 1
            lo, chars = i + 1, 0
    if lo < len(documents):
        yield lo, len(documents)


def _manifest(
    data: DataConfig,
    tok: TokenizerConfig,
    *,
    seed: int,
    key: str,
    inputs: list[dict],
    tokenizer: Tokenizer,
    counts: dict[str, _SplitCounts],
) -> dict:
    sources = []
    for i, source in enumerate(data.sources):
        sources.append(
            {
                "name": source.name,
                "files": sum(1 for r in inputs if r["source"] == i),
                "documents": {s: int(counts[s].per_source_documents[i]) for s in SPLITS},
                "tokens": {s: int(counts[s].per_source_tokens[i]) for s in SPLITS},
            }
        )
    return {
        "format": PREPARE_FORMAT,
        "key": key,
        "seed": seed,
        "val_fraction": data.val_fraction,
        "packing": "eos_after_each_document",
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "tokenizer": {
            "file": "tokenizer.json",
            "kind": tok.kind,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_token": tokenizer.eos_token,
            "eos_id": tokenizer.eos_id,
        },
        "splits": {
            s: {
                "documents": counts[s].documents,
                "tokens": counts[s].tokens,
                "shards": counts[s].names,
            }
            for s in SPLITS
        },
        "sources": sources,
        "inputs": inputs,
    }


def _load_cached(out: Path, key: str, tok: TokenizerConfig, log: Log) -> Prepared | None:
    """The complete cache entry for `key`, or None. A damaged entry is rebuilt, not trusted."""
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("key") != key:
            raise TrainbookError("manifest key differs (a 64-bit prefix collision?)")
        tokenizer = Tokenizer.load(out / "tokenizer.json", tok.eos_token)
        if tokenizer.sha256 != manifest["tokenizer"]["sha256"]:
            raise TrainbookError("tokenizer.json differs from the one the shards were made with")
        prepared = _open(out, tokenizer, manifest, cached=True)  # checks shard sizes
    except (TrainbookError, OSError, ValueError, KeyError) as e:
        log(f"cache entry {out} is damaged ({e}); preparing again")
        return None
    log(f"using cached data {out}")
    return prepared


def _open(out: Path, tokenizer: Tokenizer, manifest: dict, cached: bool) -> Prepared:
    streams = {
        s: TokenStream([out / name for name in manifest["splits"][s]["shards"]]) for s in SPLITS
    }
    return Prepared(out, tokenizer, streams["train"], streams["val"], manifest, cached)
