"""Tokenizers: a small wrapper over Hugging Face `tokenizers`, and byte-level BPE training.

Everything the rest of trainbook needs from a tokenizer is on `Tokenizer`: ids in, text out,
the vocabulary size (the model's embedding needs at least this many rows), the EOS id (placed
after every document when packing) and a sha256 that identifies it in manifests and runs.

Two choices hold for every tokenizer built here:
- Special-token strings inside the *text* are encoded as ordinary text. A document that happens
  to contain "<|endoftext|>" must not inject a real EOS; only packing places EOS tokens.
- No special tokens are added by a post-processor (no BOS): documents are packed with EOS alone.
So `decode(encode(text)) == text` for any text with a byte-level tokenizer.

Speed: `tokenizers` encodes one long text several times slower per byte than many short ones
(measured on the plays: 150 KB documents 6 s, 2 KB pieces 2.6 s, 2 cores). When the tokenizer's
pre-tokenizer is plain GPT-2 byte-level (no normalizer, so every pre-token is a match of the
GPT-2 regex on the raw text), a newline between two non-space characters always ends a
pre-token, and cutting the text there cannot change the ids: documents are encoded in pieces
cut at such newlines and the ids joined. Other tokenizers (sentencepiece-style prefix spaces,
custom split regexes) are encoded whole. Tests check pieces == whole on the plays and on text
dense in whitespace runs (where a careless cut would change the ids).

Determinism (measured with tokenizers 0.23.3; a test keeps checking it): BPE training on the
same texts gives byte-identical JSON in separate processes (Rust hash maps are seeded per
process) and with RAYON_NUM_THREADS=1 or 2: ties between merge candidates are broken by the
pair itself, and the vocabulary is serialised in id order. So nothing here pins threads.
(RAYON_NUM_THREADS is read when rayon's global pool is first used, not at import. After a `fork`
in a process that has used the pool, tokenizers turns parallelism off and warns unless
TOKENIZERS_PARALLELISM is set: a multiprocess prepare must set it, or tokenize only in children.)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainbook.config.schema import TokenizerConfig
from trainbook.atomic import atomic_write_bytes
from trainbook.errors import TrainbookError


class Tokenizer:
    """A Hugging Face tokenizer plus the EOS token trainbook packs documents with."""

    def __init__(self, hf: tokenizers.Tokenizer, eos_token: str):
        eos_id = hf.token_to_id(eos_token)
        if eos_id is None:
            raise TrainbookError(
                f"the tokenizer has no token '{eos_token}'", where="tokenizer.eos_token"
            )
        # Literal special-token strings in documents are text, not control tokens (see above).
        # This flag is not part of the JSON serialisation, so it does not change sha256.
        hf.encode_special_tokens = True
        self._hf = hf
        self.eos_token = eos_token
        self.eos_id: int = eos_id
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        spec = self.to_json()
        self.sha256: str = hashlib.sha256(spec.encode("utf-8")).hexdigest()
        self._piecewise = _cuts_at_newlines_are_safe(json.loads(spec))

    @classmethod
    def load(cls, path: str | os.PathLike, eos_token: str) -> Tokenizer:
        """Load a `tokenizer.json`; errors name `tokenizer.path` / `tokenizer.eos_token`."""
        path = Path(path)
        if not path.is_file():
            raise TrainbookError(f"no tokenizer file at '{path}'", where="tokenizer.path")
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception for any parse error
            raise TrainbookError(
                f"'{path}' is not a tokenizers JSON file: {e}", where="tokenizer.path"
            ) from e
        return cls(hf, eos_token)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts on all cores (rayon threads inside `tokenizers`)."""
        if not self._piecewise:
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        pieces = [_cut(text) for text in texts]
        flat = self._hf.encode_batch([p for ps in pieces for p in ps], add_special_tokens=False)
        out, i = [], 0
        for ps in pieces:
            out.append([t for e in flat[i : i + len(ps)] for t in e.ids])
            i += len(ps)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        # Keep special tokens: decode is the exact inverse of a packed stream, EOS included.
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self._hf.to_str()

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` atomically (a reader never sees half a file)."""
        atomic_write_bytes(Path(path), self.to_json().encode("utf-8"))

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
            f"sha256={self.sha256[:12]})"
        )


# Pieces of about this many characters: short enough for the fast path, long enough that
# per-piece overhead stays small.
PIECE_CHARS = 2048
# A newline with a non-space character on each side. Python's \s covers at least the Unicode
# White_Space set the tokenizer's regex uses, so a "non-space" here is one there too.
_SAFE_NEWLINE = re.compile(r"(?<=\S)\n(?=\S)")


def _cuts_at_newlines_are_safe(spec: dict) -> bool:
    """True when the tokenizer is plain GPT-2 byte-level (see the module docstring)."""
    pre = spec.get("pre_tokenizer") or {}
    return (
        spec.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        # Non-special added tokens are matched in the raw text, maybe across a cut.
        and all(t.get("special") for t in spec.get("added_tokens", []))
    )


def _cut(text: str) -> list[str]:
    """`text` in pieces of at least PIECE_CHARS characters (the last may be shorter), each cut
    right after a safe newline; "".join(pieces) == text."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = _SAFE_NEWLINE.search(text, start + PIECE_CHARS)
        if cut is None:
            break
        pieces.append(text[start : cut.end()])
        start = cut.end()
    pieces.append(text[start:])
    return pieces


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) with `vocab_size` tokens, EOS included.

    All 256 bytes are in the initial alphabet, so any text encodes without an unknown token,
    even characters the training text never had. Ids: 0 is EOS, 1..256 the bytes, then merges
    in the order learned. A small corpus may stop short of `vocab_size` (nothing left to
    merge); `Tokenizer.vocab_size` is what was actually built.
    """
    hf = tokenizers.Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would be added on encode and kept on decode,
    # breaking decode(encode(x)) == x.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf, eos_token)


def build_tokenizer(cfg: TokenizerConfig, texts_factory: Callable[[], Iterable[str]]) -> Tokenizer:
    """The tokenizer a recipe asks for. `texts_factory` is called only when training one."""
    if cfg.kind == "train_bpe":
        return train_bpe(texts_factory(), cfg.vocab_size, cfg.eos_token)
    if cfg.kind == "hf":
        if cfg.path is None:
            raise TrainbookError("kind 'hf' needs a tokenizer.json path", where="tokenizer.path")
        return Tokenizer.load(cfg.path, cfg.eos_token)
    raise AssertionError(f"TokenizerConfig allowed an unknown kind {cfg.kind!r}")
