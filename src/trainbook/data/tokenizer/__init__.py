"""Tokenizers: one `Tokenizer` interface over four kinds of recipe tokenizer.

| kind            | backend                  | files kept (in a saved `tokenizer/` folder)  |
|-----------------|--------------------------|----------------------------------------------|
| `train_bpe`     | `HFTokenizer`, trained   | tokenizer.json                               |
| `hf`            | `HFTokenizer`            | tokenizer.json                               |
| `sentencepiece` | `SentencePieceTokenizer` | tokenizer.model                              |
| `tiktoken`      | `TiktokenTokenizer`      | tokenizer.tiktoken (+ tiktoken_encoding.json), or encoder.json + vocab.bpe |

plus `tokenizer_meta.json` (kind, format, file sha256s, resolved specials and their ids,
add_bos, vocab_size, sha256). `Tokenizer.load(folder)` restores exactly what `save` wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from trainbook.config.data import TokenizerConfig
from trainbook.data.tokenizer.base import META_FILE, Tokenizer, backend_class
from trainbook.data.tokenizer.hf import PIECE_CHARS, HFTokenizer, train_bpe
from trainbook.data.tokenizer.hf_dir import hf_tokenizer_config, match_post_processor
from trainbook.data.tokenizer.spm import SentencePieceTokenizer
from trainbook.data.tokenizer.tiktoken_bpe import ENDOFTEXT, TiktokenTokenizer
from trainbook.errors import TrainbookError
from trainbook.pkgpath import expand_path

__all__ = [
    "META_FILE", "PIECE_CHARS", "HFTokenizer", "SentencePieceTokenizer", "TiktokenTokenizer",
    "Tokenizer", "backend_class", "build_tokenizer", "check_ids", "hf_tokenizer_config", "match_post_processor",
    "train_bpe",
]  # fmt: skip


def build_tokenizer(cfg: TokenizerConfig, texts_factory: Callable[[], Iterable[str]]) -> Tokenizer:
    """The tokenizer a recipe asks for. `texts_factory` is called only when training one."""
    specials = dict(bos_token=cfg.bos_token, pad_token=cfg.pad_token, add_bos=cfg.add_bos)
    if cfg.kind == "train_bpe":
        return train_bpe(texts_factory(), cfg.vocab_size, cfg.eos_token or ENDOFTEXT, **specials)
    backend = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer,
               "tiktoken": TiktokenTokenizer}[cfg.kind]  # fmt: skip
    if cfg.path is None:
        raise TrainbookError(f"kind '{cfg.kind}' needs a tokenizer file", where="tokenizer.path")
    files = backend.read_source(expand_path(cfg.path, "tokenizer.path"))
    if cfg.kind == "tiktoken":
        files |= TiktokenTokenizer.encoding_file(
            files, cfg.tiktoken_encoding, cfg.tiktoken_pattern, cfg.tiktoken_special_tokens
        )
    try:
        return backend(files, kind=cfg.kind, eos_token=cfg.eos_token, **specials)
    except TrainbookError as e:
        if e.where == "tokenizer.path":  # the file itself is malformed: say which file
            e.message = f"'{cfg.path}': {e.message}"
        raise


def check_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
    """Raise if any token id is outside [0, vocab_size): the embedding would index past its end
    (on GPU an opaque device-side assert, on CPU an IndexError deep in the model)."""
    if ids.size == 0:
        return
    hi, lo = int(ids.max()), int(ids.min())
    if hi >= vocab_size:
        raise TrainbookError(
            f"token id {hi} is out of range: the vocabulary has {vocab_size} ids "
            f"(largest allowed {vocab_size - 1})",
            where=where,
        )
    if lo < 0:
        raise TrainbookError(f"negative token id {lo}", where=where)
