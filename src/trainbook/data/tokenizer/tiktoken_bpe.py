"""tiktoken backend: a `.tiktoken` rank file, or a folder with GPT-2's `encoder.json` +
`vocab.bpe` (converted here to tiktoken's mergeable ranks).

Nothing is ever downloaded: ranks are parsed from bytes read here. (`tiktoken.load.
load_tiktoken_bpe` on a local path also copies the file into a cache under /tmp keyed by the
path alone, and later returns that copy even if the file has changed; a test checks that the
parser here reads a rank file exactly as `load_tiktoken_bpe` does.)

A rank file holds neither the split regex nor the special tokens. By default both forms use
GPT-2's regex and one special token, `<|endoftext|>`: for GPT-2 files the id `encoder.json`
gives it (50256); for a rank file the first id no rank uses (50256 for `r50k_base` and
`p50k_base`). For other encodings the recipe names one (`tokenizer.tiktoken_encoding`:
cl100k_base, o200k_base, llama3) or gives the regex and specials; they are kept beside the rank
file as `tiktoken_encoding.json`, so a saved or pickled tokenizer carries them and its sha256
covers them.
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
ENCODING_FILE = "tiktoken_encoding.json"  # the regex and specials of a rank file, when set
ENCODER_FILE, MERGES_FILE = "encoder.json", "vocab.bpe"
ENDOFTEXT = "<|endoftext|>"
EOS_NAMES, BOS_NAMES = (ENDOFTEXT, "<|end_of_text|>"), ("<|begin_of_text|>",)
# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, other-symbol runs (each with an
# optional leading space), then whitespace not followed by a non-space, then any whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# cl100k_base and o200k_base as tiktoken defines them (tiktoken_ext/openai_public.py), Llama 3 as
# Meta's tokenizer.py does: regex, specials, and the number of ranks its file holds.
_O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])  # fmt: skip
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
]  # fmt: skip
ENCODINGS: dict[str, tuple[str, dict[str, int], int]] = {
    "cl100k_base": (
        r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
        {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
         "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
        100256,
    ),
    "o200k_base": (_O200K_PATTERN, {ENDOFTEXT: 199999, "<|endofprompt|>": 200018}, 199998),
    "llama3": (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
        {token: 128000 + i for i, token in enumerate(_LLAMA3_SPECIALS)},
        128000,
    ),
}  # fmt: skip
# Text every recipe's regex must match whole.
_COVERAGE = "Ab c's 12345 ,.;!? \t\n\n  x\r\n é日本 😀 e\u0301\u00a0\u3000 end  "


class TiktokenTokenizer(Tokenizer):
    format = "tiktoken"

    @staticmethod
    def read_source(path: str | os.PathLike) -> dict[str, bytes]:
        path = Path(path)
        if path.is_dir():
            return {name: read_file(path / name) for name in (ENCODER_FILE, MERGES_FILE)}
        return {RANKS_FILE: read_file(path)}

    @staticmethod
    def encoding_file(
        files: dict[str, bytes], encoding: str | None, pattern: str | None,
        special_tokens: dict[str, int] | None,
    ) -> dict[str, bytes]:
        """`{ENCODING_FILE: ...}` for the recipe's `tiktoken_*` fields; {} when none is set."""
        given = {"tiktoken_encoding": encoding, "tiktoken_pattern": pattern,
                 "tiktoken_special_tokens": special_tokens}  # fmt: skip
        given = {key: value for key, value in given.items() if value is not None}
        if not given:
            return {}
        if RANKS_FILE not in files:
            why = f"applies to a rank file, not GPT-2's {ENCODER_FILE} + {MERGES_FILE}"
            raise TrainbookError(why, where=f"tokenizer.{next(iter(given))}")
        preset = ENCODINGS[encoding] if encoding else (GPT2_PATTERN, None, None)
        preset_pattern, preset_specials, n_ranks = preset
        spec = {
            "encoding": encoding,
            "ranks": n_ranks,
            "pattern": preset_pattern if pattern is None else pattern,
            "special_tokens": preset_specials if special_tokens is None else special_tokens,
        }
        if pattern is not None:
            _check_pattern(pattern)
        return {ENCODING_FILE: json.dumps(spec, sort_keys=True, indent=1).encode("utf-8")}

    def _parse(self, files: dict[str, bytes], where: str) -> None:
        pattern, spec = GPT2_PATTERN, {}
        try:
            if RANKS_FILE in files:
                ranks = _parse_ranks(files[RANKS_FILE])
                spec = json.loads(files[ENCODING_FILE]) if ENCODING_FILE in files else {}
                pattern = spec.get("pattern", GPT2_PATTERN)
                specials = spec.get("special_tokens")
                if specials is None:
                    used = set(ranks.values())
                    specials = {ENDOFTEXT: next(i for i in range(len(used) + 1) if i not in used)}
            else:
                ranks, specials = _gpt2_ranks(files[ENCODER_FILE], files[MERGES_FILE])
        except Exception as e:
            raise TrainbookError(f"not a tiktoken/GPT-2 BPE: {one_line(e)}", where=where) from e
        if spec.get("ranks") not in (None, len(ranks)):
            why = (f"{spec['encoding']}'s rank file has {spec['ranks']:,} ranks; "
                   f"this one has {len(ranks):,}")  # fmt: skip
            raise TrainbookError(why, where=_recipe_key(where, "tiktoken_encoding"))
        _check_specials(specials, ranks, _recipe_key(where, "tiktoken_special_tokens"))
        try:
            self._enc = tiktoken.Encoding(
                "trainbook", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as e:
            raise TrainbookError(f"not a tiktoken/GPT-2 BPE: {one_line(e)}", where=where) from e
        self._ranks, self._specials = ranks, specials

    def _vocab_size(self) -> int:
        return self._enc.max_token_value + 1

    def _own_specials(self):
        eos = next((t for t in EOS_NAMES if t in self._specials), None)
        bos = next((t for t in BOS_NAMES if t in self._specials), None)
        return eos, bos, None

    def _eos_candidates(self) -> str:
        return " or ".join(EOS_NAMES)

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        return self._ranks.get(token.encode("utf-8"))

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        # "ordinary": special-token strings in the text are text.
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids))


def _recipe_key(where: str, field: str) -> str:
    # A tokenizer built from a recipe has where "tokenizer.path": name the field that set the value;
    # a saved one keeps naming its folder.
    return f"tokenizer.{field}" if where == "tokenizer.path" else where


def _check_pattern(pattern: str) -> None:
    """A recipe's regex: one tiktoken compiles, matching all of a varied text (tiktoken encodes
    only the matches, so a regex that skips characters would drop them silently)."""
    where = "tokenizer.tiktoken_pattern"
    byte_ranks = {bytes([b]): b for b in range(256)}
    try:
        enc = tiktoken.Encoding("check", pat_str=pattern, mergeable_ranks=byte_ranks, special_tokens={})
    except Exception as e:
        raise TrainbookError(f"not a regex tiktoken accepts: {one_line(e)}", where=where) from e
    if enc.decode(enc.encode_ordinary(_COVERAGE)) != _COVERAGE:
        raise TrainbookError(f"does not match all of {_COVERAGE!r}: the rest would be dropped", where=where)


def _check_specials(specials: dict[str, int], ranks: dict[bytes, int], where: str) -> None:
    taken = set(ranks.values())
    seen: dict[int, str] = {}
    for token, i in specials.items():
        if not isinstance(i, int) or i < 0:
            raise TrainbookError(f"'{token}': id {i!r} is not an integer >= 0", where=where)
        if i in taken:
            raise TrainbookError(f"'{token}': id {i} is a rank of the file", where=where)
        if i in seen:
            raise TrainbookError(f"'{token}' and '{seen[i]}' have the same id {i}", where=where)
        seen[i] = token


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


def byte_to_unicode() -> dict[int, str]:
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
    to_byte = {c: b for b, c in byte_to_unicode().items()}
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
