"""Hugging Face `tokenizers` backend (`tokenizer.json`), and byte-level BPE training.

- Special-token strings inside the *text* are encoded as ordinary text: a document that happens
  to contain "<|endoftext|>" must not inject a real EOS; only packing places EOS tokens.
- No post-processor specials (`add_special_tokens=False`): BOS, when wanted, comes from
  `add_bos`. So `decode(encode(text)) == text` for any text with a byte-level tokenizer (as its
  normal form where the file normalises: Qwen's NFC gives "e" + U+0301 back as "é").

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

import json
import os
import re
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainbook.data.tokenizer.base import Tokenizer, read_file
from trainbook.errors import TrainbookError, one_line

FILE = "tokenizer.json"
# Looked up in this order when the recipe leaves a special token unset, among the file's special
# added tokens only: a regular vocabulary entry spelled the same is text (Qwen's BPE has "</s>" and
# "<s>" as ordinary merges, ids 128247 and 128245; as EOS, a document's literal "</s>" would end it).
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")
PAD_CANDIDATES = ("<pad>", "<|pad|>")


class HFTokenizer(Tokenizer):
    """A `tokenizers` JSON file (kinds `hf` and `train_bpe`)."""

    format = "hf"

    @staticmethod
    def read_source(path: str | os.PathLike) -> dict[str, bytes]:
        return {FILE: read_file(path)}

    def _parse(self, files: dict[str, bytes], where: str) -> None:
        try:
            text = files[FILE].decode("utf-8")
            hf = tokenizers.Tokenizer.from_str(text)
            spec = json.loads(text)
        except Exception as e:  # the Rust side raises plain Exception for any parse error
            raise TrainbookError(
                f"not a tokenizers JSON file: {one_line(e)}", where=where
            ) from e
        # Literal special-token strings in documents are text, not control tokens (see above).
        hf.encode_special_tokens = True
        self._hf = hf
        self._piecewise = _cuts_at_newlines_are_safe(spec)

    def _vocab_size(self) -> int:
        return max(self._hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def _first_present(self, candidates: tuple[str, ...]) -> str | None:
        specials = {t.content for t in self._hf.get_added_tokens_decoder().values() if t.special}
        return next((t for t in candidates if t in specials), None)

    def _own_specials(self):
        candidates = (EOS_CANDIDATES, BOS_CANDIDATES, PAD_CANDIDATES)
        return tuple(self._first_present(c) for c in candidates)

    def _eos_candidates(self) -> str:
        return ", ".join(EOS_CANDIDATES)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
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
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def encode_offsets(self, text: str, specials: bool) -> tuple[list[int], list[tuple[int, int]]]:
        # One pass over the whole text (never cut), as transformers' apply_chat_template encodes.
        self._hf.encode_special_tokens = not specials
        try:
            encoding = self._hf.encode(text, add_special_tokens=False)
        finally:
            self._hf.encode_special_tokens = True
        ids, offsets = list(encoding.ids), [tuple(o) for o in encoding.offsets]
        if self.add_bos and not specials:
            ids, offsets = [self.bos_id, *ids], [(0, 0), *offsets]
        return ids, offsets

    def special_strings(self) -> list[str]:
        return [t.content for t in self._hf.get_added_tokens_decoder().values() if t.special]


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


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    eos_token: str = "<|endoftext|>",
    *,
    bos_token: str | None = None,
    pad_token: str | None = None,
    add_bos: bool = False,
) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style) with `vocab_size` tokens, specials included.

    All 256 bytes are in the initial alphabet, so any text encodes without an unknown token,
    even characters the training text never had. Ids: the specials first (EOS is 0, then BOS
    and PAD when named), then the bytes, then merges in the order learned. A small corpus may
    stop short of `vocab_size` (nothing left to merge); `.vocab_size` is what was built.
    """
    specials = list(dict.fromkeys(t for t in (eos_token, bos_token, pad_token) if t is not None))
    hf = tokenizers.Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would be added on encode and kept on decode,
    # breaking decode(encode(x)) == x.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(
        {FILE: hf.to_str().encode("utf-8")},
        kind="train_bpe",
        eos_token=eos_token,
        bos_token=bos_token,
        pad_token=pad_token,
        add_bos=add_bos,
    )
