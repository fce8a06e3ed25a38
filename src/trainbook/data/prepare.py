"""prepare: sources -> clean -> dedup -> train/val split -> tokenizer -> token shards, cached.

    <cache_dir>/<key>/
      tokenizer/                       the tokenizer (files + tokenizer_meta.json)
      train-<source>-00000.bin/.json   one packed stream per source (doc EOS doc EOS ...)
      val-<source>-00000.bin/.json
      {train,val}-<source>-mask-00000.bin/.json   with chat data: a byte per token (data/chat.py)
      manifest.json                    written last: its presence means the entry is complete

`key` hashes everything the shards depend on: the data and tokenizer settings, the seed, the
format of what prepare writes, and every input file's path, size and content hash. Any change
gives a new directory; an unchanged recipe reuses the shards without reading a document.

Memory stays bounded whatever the corpus size: documents stream through (see documents.py),
at most `2 * num_proc` chunks are being tokenized at once, and a shard writer holds at most one
shard. Only the deduplication index grows with the number of documents.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from trainbook.atomic import atomic_write_json
from trainbook.config.data import DataConfig, TokenizerConfig
from trainbook.data.chat import CHAT_FORMAT, CHAT_FORMATS, ChatEncoder, chat_encoder, has_chat, optional_template, text_bits
from trainbook.data.documents import Document, DocumentStream
from trainbook.data.shards import ShardWriter, TokenStream, token_dtype, verify_shard
from trainbook.data.sources import locate_record, resolve_paths
from trainbook.data.tokenizer import Tokenizer, build_tokenizer, check_ids
from trainbook.errors import TrainbookError
from trainbook.pkgpath import expand_path

# Bump when prepare would write different shards for the same inputs (conversion, cleaning,
# split or packing rules): old cache entries then stop matching instead of being reused.
PREPARE_FORMAT = 2
SPLITS = ("train", "val")
# Characters per tokenization chunk: large enough to amortise the hand-off to a worker,
# small enough that 2 * num_proc chunks in flight stay a few tens of MB.
CHUNK_CHARS = 1_000_000
PROGRESS_EVERY_S = 5.0

Log = Callable[[str], None]


@dataclass(frozen=True)
class Prepared:
    dir: Path
    """The cache entry: tokenizer/, shards, manifest.json."""
    tokenizer: Tokenizer
    train: dict[str, TokenStream]
    """Source name -> its packed train stream (memory-mapped shards), in recipe order."""
    val: TokenStream
    """Every source's validation documents as one packed stream; empty when val_fraction is 0."""
    manifest: dict
    """Counts, report, tokenizer sha256, cache key, inputs: the contents of manifest.json."""
    cached: bool
    """True when an existing cache entry was reused (nothing was read or tokenized)."""
    train_masks: dict[str, TokenStream] | None = None
    """Chat data: each train stream's mask bytes, token for token (data/chat.py); else None."""
    val_mask: TokenStream | None = None
    """Chat data: the validation stream's mask bytes; else None."""


def prepare(data: DataConfig, tok: TokenizerConfig, *, seed: int, log: Log | None = None) -> Prepared:
    """Make (or find in the cache) the tokenized train/val streams of a recipe's corpus."""
    log = log or (lambda message: None)
    if not data.sources:
        raise TrainbookError("no data sources configured", where="data.sources")
    inputs = _hash_inputs(data)
    key = cache_key(data, tok, seed=seed, inputs=inputs)
    out = Path(data.cache_dir) / key[:16]
    found = _load_cached(out, key, log)
    if found is not None:
        return found

    # Bad input found while preparing (a source with no documents, a malformed record) leaves
    # nothing behind: the directories this call creates are removed again.
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # a damaged entry is incomplete from now on
    try:
        return _build(out, data, tok, seed, key, inputs, log)
    except TrainbookError:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise



def find_prepared(data: DataConfig, tok: TokenizerConfig, *, seed: int, log: Log | None = None) -> Prepared | None:
    """The complete, checked cache entry `prepare` would reuse, or None when there is none (or
    it is damaged: `log` says why). Reads the inputs to hash them; writes nothing."""
    if not data.sources:
        raise TrainbookError("no data sources configured", where="data.sources")
    key = cache_key(data, tok, seed=seed, inputs=_hash_inputs(data))
    return _load_cached(Path(data.cache_dir) / key[:16], key, log or (lambda message: None))

def _build(out: Path, data: DataConfig, tok: TokenizerConfig, seed: int, key: str, inputs: list[dict],
           log: Log) -> Prepared:
    documents = DocumentStream(data, seed)
    chat = has_chat(data)
    if chat and tok.kind == "train_bpe":
        raise TrainbookError("chat and prompt_completion data need the model's own tokenizer (kind 'hf', "
                             "a tokenizer.json with its chat template's special tokens), not a trained BPE",
                             where="tokenizer.kind")
    if tok.kind == "train_bpe":
        # Pass 1: train on train documents only, so validation text stays unseen by every part.
        log(f"training a BPE tokenizer (vocab {tok.vocab_size}) on the train documents")
    tokenizer = build_tokenizer(tok, lambda: (d.text for d in documents if not d.is_val))
    tokenizer.save(out / "tokenizer")

    input_bytes = sum(r["bytes"] for r in inputs)
    log(f"tokenizing {len(inputs)} files ({input_bytes / 1e6:,.1f} MB) with {data.num_proc} process(es)")
    start = time.perf_counter()
    encoder = chat_encoder(data, tok, tokenizer) if chat else None
    shards = _write_shards(out, data, documents, tokenizer, log, encoder)
    elapsed = time.perf_counter() - start
    manifest = _manifest(data, tok, seed, key, inputs, tokenizer, shards, documents, elapsed)
    atomic_write_json(out / "manifest.json", manifest)  # last: marks the entry complete
    for line in report_lines(manifest):
        log(line)
    return _open(out, tokenizer, manifest, cached=False)


def cache_key(data: DataConfig, tok: TokenizerConfig, *, seed: int, inputs: list[dict]) -> str:
    """sha256 (hex) over every input of prepare that can change what it writes."""
    tokenizer = tok.model_dump()
    if tok.kind == "train_bpe":
        # Training results may change with the library version; a new version retrains.
        tokenizer["tokenizers"] = tokenizers.__version__
    else:
        if tok.path is None:
            raise TrainbookError(f"kind '{tok.kind}' needs a tokenizer file", where="tokenizer.path")
        tokenizer["files_sha256"] = _path_sha256(Path(expand_path(tok.path, "tokenizer.path")), "tokenizer.path")
    payload = {
        "format": PREPARE_FORMAT,
        # `weight` is left out: it steers sampling from prepared data, not what is prepared.
        "sources": [s.model_dump(exclude={"weight"}) for s in data.sources],
        "clean": data.clean.model_dump(),
        "dedup": data.dedup.model_dump(),
        "val_fraction": data.val_fraction,
        "shard_tokens": data.shard_tokens,
        "seed": seed,
        "tokenizer": tokenizer,
        "inputs": inputs,
    }
    if has_chat(data):  # the template decides the ids and the masks
        template = optional_template(tok)
        payload["chat"] = {"format": CHAT_FORMAT,
                           "template_sha256": template and hashlib.sha256(template[0].encode()).hexdigest()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


# ---- tokenizing into shards ----------------------------------------------------------------


def _write_shards(
    out: Path, data: DataConfig, documents: DocumentStream, tokenizer: Tokenizer, log: Log,
    encoder: ChatEncoder | None = None,
) -> dict[str, dict[str, ShardWriter]]:
    """Pass 2: tokenize every document once, append EOS, stream it into its (source, split) shards;
    with an `encoder` (chat data), every token's mask byte into the source's mask shards too."""
    dtype = token_dtype(tokenizer.vocab_size)

    def writers_of(suffix: str, dtype: np.dtype) -> dict[str, dict[str, ShardWriter]]:
        return {split: {s.name: ShardWriter(out, f"{split}-{i:02d}{suffix}", dtype, data.shard_tokens,
                                            meta={"source": s.name, "split": split,
                                                  "tokenizer_sha256": tokenizer.sha256})
                        for i, s in enumerate(data.sources)}
                for split in SPLITS}

    writers = writers_of("", dtype)
    masks = writers_of("-mask", np.dtype("<u1")) if encoder is not None else None
    chat = [s.format in CHAT_FORMATS for s in data.sources]
    names = [s.name for s in data.sources]
    progress = _Progress(log)
    for chunk, (lengths, ids) in _tokenized_chunks(documents, tokenizer, data.num_proc, chat):
        check_ids(ids, tokenizer.vocab_size, where="tokenizer")
        ends = np.cumsum(lengths)
        tokens = len(ids)
        for doc, end, length in zip(chunk, ends, lengths):
            split, name = "val" if doc.is_val else "train", names[doc.source]
            if not chat[doc.source]:
                writers[split][name].add(ids[end - length : end])
                if masks is not None:  # a text document trains every token
                    masks[split][name].add(text_bits(int(length)))
                continue
            doc_ids, bits = _encode_chat(encoder, data, doc)
            check_ids(doc_ids, tokenizer.vocab_size, where="tokenizer")
            writers[split][name].add(doc_ids)
            masks[split][name].add(bits)
            tokens += len(doc_ids) - 1
        progress.update(len(chunk), sum(len(d.text) for d in chunk), tokens)
    for group in (writers, masks or {}):
        for by_source in group.values():
            for writer in by_source.values():
                writer.close()
    if masks is not None:
        for split in SPLITS:
            for name, writer in masks[split].items():
                writers[split][name].mask_names = writer.names
    return writers


def _encode_chat(encoder: ChatEncoder, data: DataConfig, doc: Document) -> tuple[np.ndarray, np.ndarray]:
    """`encoder.encode` of one conversation; an error it raises names the record's file and line
    (found by reading the source again: only on that error path)."""
    source, where = data.sources[doc.source], f"data.sources[{doc.source}]"
    try:
        return encoder.encode(doc.text, where)
    except TrainbookError as e:
        record = locate_record(source, doc.text, where)
        if record is not None:
            e.message = f"{record}: {e.message}"
            e.args = (e.message,)
        raise


def _tokenized_chunks(
    documents: DocumentStream, tokenizer: Tokenizer, num_proc: int, chat: list[bool] | None = None,
) -> Iterator[tuple[list[Document], tuple[np.ndarray, np.ndarray]]]:
    """(documents, (per-document lengths, concatenated ids with EOS)) in document order; the
    documents of `chat` sources are left out (encoded as empty: a chat encoder takes them)."""
    chunks = _chunks(documents, CHUNK_CHARS)

    def texts(chunk: list[Document]) -> list[str]:
        return [d.text if not (chat and chat[d.source]) else "" for d in chunk]

    if num_proc == 1:
        for chunk in chunks:
            yield chunk, _encode_chunk(tokenizer, texts(chunk))
        return
    ctx = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and locks
    with ctx.Pool(num_proc, initializer=_worker_init, initargs=(tokenizer,)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(_worker_encode, (texts(chunk),))))
            if len(pending) >= 2 * num_proc:  # bounded: never read far ahead of the workers
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


def _chunks(documents: DocumentStream, max_chars: int) -> Iterator[list[Document]]:
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc.text)
        if chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode_chunk(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of each text followed by EOS, concatenated, and each document's length."""
    dtype = token_dtype(tokenizer.vocab_size)
    encoded = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    ids = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for doc_ids, end, length in zip(encoded, ends, lengths):
        ids[end - length : end - 1] = doc_ids
        ids[end - 1] = tokenizer.eos_id  # EOS after every document, the last one too
    return lengths, ids


# A worker process's own tokenizer, set once by the pool initializer: sending it with every
# chunk would pickle the whole vocabulary each time.
_worker_tokenizer: Tokenizer | None = None


def _worker_init(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _encode_chunk(_worker_tokenizer, texts)


class _Progress:
    def __init__(self, log: Log):
        self.log = log
        self.start = self.last = time.perf_counter()
        self.documents = self.chars = self.tokens = 0

    def update(self, documents: int, chars: int, tokens: int) -> None:
        self.documents += documents
        self.chars += chars
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            rate = self.chars / (now - self.start) / 1e6
            self.log(f"  {self.documents:,} documents, {self.chars / 1e6:,.1f} M chars, "
                     f"{self.tokens:,} tokens ({rate:.1f} M chars/s)")


# ---- manifest, report, cache ---------------------------------------------------------------


def _manifest(data, tok, seed, key, inputs, tokenizer, shards, documents, elapsed) -> dict:
    sources = []
    for i, (source, report) in enumerate(zip(data.sources, documents.reports)):
        sources.append({
            **report.as_dict(),
            "files": sum(1 for r in inputs if r["source"] == i),
            "shards": {split: shards[split][source.name].names for split in SPLITS},
            **({"masks": {split: shards[split][source.name].mask_names for split in SPLITS}}
               if shards["train"][source.name].mask_names is not None else {}),
            "tokens": {split: shards[split][source.name].tokens for split in SPLITS},
        })
    return {
        "format": PREPARE_FORMAT,
        "key": key,
        "seed": seed,
        "val_fraction": data.val_fraction,
        "packing": "eos_after_each_document",
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "tokenizer": {"dir": "tokenizer", "kind": tok.kind, "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
        "splits": {
            split: {
                "documents": sum(s["documents_out"][split] for s in sources),
                "tokens": sum(s["tokens"][split] for s in sources),
            }
            for split in SPLITS
        },
        "sources": sources,
        "seconds": round(elapsed, 3),
        "inputs": inputs,
    }


def report_lines(manifest: dict) -> list[str]:
    """The prepare report: per source, documents in and out, what was dropped and why, tokens."""
    lines = []
    for s in manifest["sources"]:
        read, cleaning, dup = s["read"], s["cleaning"], s["duplicates"]
        dropped = {k.removeprefix("dropped_"): v for k, v in cleaning.items() if k.startswith("dropped_") and v}
        utf8 = {k: v for k, v in read.items() if k.startswith("invalid_utf8") and v}
        lines.append(
            f"{s['name']}: {s['files']} files, {read['documents']:,} documents read"
            + (f", invalid UTF-8 {utf8}" if utf8 else "")
            + (f", dropped {dropped}" if dropped else "")
            + f", duplicates exact {dup['exact']:,} near {dup['near']:,}"
            + f" -> train {s['documents_out']['train']:,} docs / {s['tokens']['train']:,} tokens,"
            + f" val {s['documents_out']['val']:,} docs / {s['tokens']['val']:,} tokens"
        )
    splits = manifest["splits"]
    lines.append(
        f"prepared in {manifest['seconds']:.1f} s: {splits['train']['tokens']:,} train tokens, "
        f"{splits['val']['tokens']:,} val tokens"
    )
    return lines


def _hash_inputs(data: DataConfig) -> list[dict]:
    """One record per input file: which source (index), where, how big, what content."""
    records = []
    for i, source in enumerate(data.sources):
        where = f"data.sources[{i}].paths"
        for path in resolve_paths(source.paths, where=where):
            records.append({
                "source": i, "path": str(path.resolve()), "bytes": path.stat().st_size,
                "sha256": _path_sha256(path, where),
            })
    return records


def _path_sha256(path: Path, where: str) -> str:
    """Content hash of a file, or of every file in a directory (tokenizers given as folders)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    try:
        for file in files:
            digest.update(file.name.encode() + b"\0")
            with open(file, "rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
    except OSError as e:
        raise TrainbookError(f"cannot read '{path}': {e.strerror or e}", where=where) from e
    return digest.hexdigest()


def _load_cached(out: Path, key: str, log: Log) -> Prepared | None:
    """The complete cache entry for `key`, or None. A damaged entry is rebuilt, not trusted."""
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("key") != key:
            raise TrainbookError("manifest key differs (a 64-bit prefix collision?)")
        tokenizer = Tokenizer.load(out / "tokenizer")
        if tokenizer.sha256 != manifest["tokenizer"]["sha256"]:
            raise TrainbookError("the tokenizer differs from the one the shards were made with")
        prepared = _open(out, tokenizer, manifest, cached=True)  # checks shard sizes
        for source in manifest["sources"]:  # and every shard's checksum against its index
            masks = source.get("masks", {"train": [], "val": []})
            for name in source["shards"]["train"] + source["shards"]["val"] + masks["train"] + masks["val"]:
                verify_shard(out / name)
    except (TrainbookError, OSError, ValueError, KeyError) as e:
        log(f"cache entry {out} is damaged ({e}); preparing again")
        return None
    log(f"using cached data {out}")
    return prepared


def _open(out: Path, tokenizer: Tokenizer, manifest: dict, cached: bool) -> Prepared:
    sources = manifest["sources"]
    train = {s["name"]: TokenStream([out / n for n in s["shards"]["train"]]) for s in sources}
    val = TokenStream([out / n for s in sources for n in s["shards"]["val"]])
    if "masks" not in sources[0]:
        return Prepared(out, tokenizer, train, val, manifest, cached)
    train_masks = {s["name"]: TokenStream([out / n for n in s["masks"]["train"]]) for s in sources}
    val_mask = TokenStream([out / n for s in sources for n in s["masks"]["val"]])
    return Prepared(out, tokenizer, train, val, manifest, cached, train_masks, val_mask)
