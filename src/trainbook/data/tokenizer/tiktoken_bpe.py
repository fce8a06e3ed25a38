"""tiktoken backend: a `.tiktoken` rank file, or a folder with GPT-2's `encoder.json` +
`vocab.bpe` (converted here to tiktoken's mergeable ranks).

Nothing is ever downloaded: ranks are parsed from bytes read here. (`tiktoken.load.
load_tiktoken_bpe` on a local path also copies the file into a cache under /tmp keyed by the
path alone, and later returns that copy even if the file has changed; a test checks that the
parser here reads a rank file exactly as `load_tiktoken_bpe` does.)

Both forms use GPT-2's split regex and one special token, `<|endoftext|>`: for GPT-2 files the
id `encoder.json` gives it (50256); for a rank file the first id no rank uses (50256 for
`r50k_base` and `p50k_base`). Encodings with another regex or other specials (cl100k_base,
o200k_base, Llama 3) would need those in the recipe.
# TODO(tokenizer): TokenizerConfig has no pattern/specials fields yet; add them for cl100k/o200k.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable
from pathlib import Path

import tiktoken

from trainbook.data.tokenizer.base import Tokenizer, read_file
from trainbook.errors import TrainbookError, one_line

RANKS_FILE = "tokenizer.tiktoken"
ENCODER_FILE, MERGES_FILE = "encoder.json", "vocab.bpe"
ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, other-symbol runs (each with an
# optional leading space), then whitespace not followed by a non-space, then any whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TiktokenTokenizer(Tokenizer):
    format = "tiktoken"

    @staticmethod
    def read_source(path: str | os.PathLike) -> dict[str, bytes]:
        path = Path(path)
        if path.is_dir():
            return {name: read_file(path / name) for name in (ENCODER_FILE, MERGES_FILE)}
        return {RANKS_FILE: read_file(path)}

    def _parse(self, files: dict[str, bytes], where: str) -> None:
        try:
            if RANKS_FILE in files:
                ranks = _parse_ranks(files[RANKS_FILE])
                used = set(ranks.values())
                specials = {ENDOFTEXT: next(i for i in range(len(used) + 1) if i not in used)}
            else:
                ranks, specials = _gpt2_ranks(files[ENCODER_FILE], files[MERGES_FILE])
            self._enc = tiktoken.Encoding(
                "trainbook", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as e:
            raise TrainbookError(f"not a tiktoken/GPT-2 BPE: {one_line(e)}", where=where) from e
        self._ranks, self._specials = ranks, specials

    def _vocab_size(self) -> int:
        return self._enc.max_token_value + 1

    def _own_specials(self):
        return ENDOFTEXT, None, None

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        return self._ranks.get(token.encode("utf-8"))

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        # "ordinary": special-token strings in the text are text.
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids))


def _parse_ranks(data: bytes) -> dict[bytes, int]:
    """A `.tiktoken` file: one `base64(token) rank` per line."""
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"line {n} is not 'base64-token rank': {line[:60]!r}") from e
    if not ranks:
        raise ValueError("no ranks")
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: bytes that are visible, non-space Latin-1
    characters stand for themselves; the other 68 take characters 256, 257, ... in order."""
    visible = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in visible:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _gpt2_ranks(encoder_json: bytes, merges: bytes) -> tuple[dict[bytes, int], dict[str, int]]:
    """Mergeable ranks and specials from GPT-2's files. tiktoken merges the adjacent pair whose
    joined bytes have the lowest rank; that is GPT-2's merge order only when each merge's
    result is ranked after the results of all earlier merges, so that is checked."""
    encoder = json.loads(encoder_json)
    to_byte = {c: b for b, c in _byte_to_unicode().items()}
    ranks, specials = {}, {}
    for token, i in encoder.items():
        if token == ENDOFTEXT:
            specials[token] = i
        elif all(c in to_byte for c in token):
            ranks[bytes(to_byte[c] for c in token)] = i
        else:
            raise ValueError(f"{ENCODER_FILE}: token {token!r} is not byte-level")
    if ENDOFTEXT not in specials:
        raise ValueError(f"{ENCODER_FILE} has no {ENDOFTEXT}")
    last = -1
    for n, line in enumerate(merges.decode("utf-8").splitlines(), 1):
        if not line or line.startswith("#version"):
            continue
        parts = line.split(" ")
        rank = encoder.get("".join(parts)) if len(parts) == 2 else None
        if rank is None or rank <= last:
            raise ValueError(f"{MERGES_FILE} line {n} ({line[:40]!r}) is out of rank order")
        last = rank
    return ranks, specials
