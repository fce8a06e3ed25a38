"""The `Tokenizer` interface every backend implements, and what all of them share: special-token
resolution, BOS placement, the identifying sha256, save/load of a `tokenizer/` folder, pickling.

A backend is built from its files' *bytes* (`files`: canonical name -> content), never from a
path it keeps: so a pickled tokenizer carries its model to a `multiprocessing` worker, and a
saved one is exactly what was built.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

from trainbook.atomic import atomic_write_bytes, atomic_write_json
from trainbook.errors import TrainbookError, one_line

META_FILE = "tokenizer_meta.json"
META_VERSION = 1
SPECIALS = ("eos", "bos", "pad")


class Tokenizer(ABC):
    """Ids in, text out; the specials packing needs; a sha256 that identifies it in manifests.

    `vocab_size` is the number of ids the model must embed (largest id + 1, specials included).
    Special-token strings inside the text are encoded as ordinary text in every backend: only
    packing places EOS (and BOS, with `add_bos`).
    """

    format: ClassVar[str]
    """The file format ("hf", "sentencepiece", "tiktoken"); `kind` says how it was obtained."""

    def __init__(
        self,
        files: dict[str, bytes],
        *,
        kind: str,
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
        add_bos: bool = False,
        where: str = "tokenizer.path",
    ):
        self.files = dict(files)
        self.kind = kind
        self._parse(self.files, where)  # errors name `where`: the recipe key, or the saved folder
        self.vocab_size: int = self._vocab_size()
        own = dict(zip(SPECIALS, self._own_specials()))
        explicit = {"eos": eos_token, "bos": bos_token, "pad": pad_token}
        resolved = {name: self._resolve(name, explicit[name], own[name]) for name in SPECIALS}
        self.eos_token, eos_id = resolved["eos"]
        if eos_id is None:
            raise TrainbookError(
                f"the tokenizer has no end-of-text token of its own "
                f"(looked for {self._eos_candidates()}): set tokenizer.eos_token",
                where="tokenizer.eos_token",
            )
        self.eos_id: int = eos_id
        self.bos_token, self.bos_id = resolved["bos"]
        self.pad_token, self.pad_id = resolved["pad"]
        if add_bos and self.bos_id is None:
            raise TrainbookError(
                "add_bos is set but the tokenizer has no BOS token: set tokenizer.bos_token",
                where="tokenizer.add_bos",
            )
        self.add_bos = add_bos
        self.sha256: str = hashlib.sha256(_canonical(self._identity())).hexdigest()

    # --- what a backend provides ------------------------------------------------------------

    @abstractmethod
    def _parse(self, files: dict[str, bytes], where: str) -> None:
        """Build the backend's model from `files`; TrainbookError(where=where) if malformed."""

    @abstractmethod
    def _vocab_size(self) -> int: ...

    @abstractmethod
    def _own_specials(self) -> tuple[str | None, str | None, str | None]:
        """The backend's own (eos, bos, pad) tokens, None where it has none."""

    def _eos_candidates(self) -> str:
        return "an EOS token"

    @abstractmethod
    def token_to_id(self, token: str) -> int | None: ...

    @abstractmethod
    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, no specials added."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are kept (decode inverts a packed stream, EOS included)."""

    # --- the interface ----------------------------------------------------------------------

    def encode_offsets(self, text: str, specials: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` and each one's character range (chat data, data/chat.py), BOS prepended
        as `encode` does when not `specials`; with `specials`, special-token strings in the text
        are control tokens (a chat template's rendering, which places them itself)."""
        raise TrainbookError(
            f"chat and prompt_completion data need a tokenizer.json tokenizer (kind 'hf'), not kind '{self.kind}'",
            where="tokenizer.kind")

    def special_strings(self) -> list[str]:
        """The special tokens' strings (a chat message may not spell one)."""
        return [t for t in (self.eos_token, self.bos_token, self.pad_token) if t]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        out = self._encode_batch(list(texts))
        if self.add_bos:
            out = [[self.bos_id, *ids] for ids in out]
        return out

    def save(self, directory: str | os.PathLike) -> None:
        """Write the backend's files, then `tokenizer_meta.json`, each atomically. The meta file
        is written last: a folder with one describes complete files."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            atomic_write_bytes(directory / name, data)
        atomic_write_json(directory / META_FILE, self.meta())

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """The tokenizer `save(directory)` wrote: same ids, same sha256, or a TrainbookError."""
        meta_path = Path(directory) / META_FILE
        where = str(meta_path)
        if not meta_path.is_file():
            raise TrainbookError("no saved tokenizer here", where=where)
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            backend = backend_class(meta["format"])
            files = {}
            for name, digest in meta["files"].items():
                files[name] = (meta_path.parent / name).read_bytes()
                if hashlib.sha256(files[name]).hexdigest() != digest:
                    raise TrainbookError(f"'{name}' changed since it was saved", where=where)
            specials = {f"{n}_token": (meta[n] or {}).get("token") for n in SPECIALS}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TrainbookError(f"unreadable saved tokenizer: {one_line(e)}", where=where) from e
        tok = backend(files, kind=meta["kind"], add_bos=meta["add_bos"], where=where, **specials)
        if tok.meta() != meta:
            raise TrainbookError("the tokenizer differs from the one saved", where=where)
        return tok

    def meta(self) -> dict:
        """The contents of `tokenizer_meta.json`."""
        return {
            "version": META_VERSION,
            "kind": self.kind,
            "format": self.format,
            "files": {n: hashlib.sha256(d).hexdigest() for n, d in sorted(self.files.items())},
            **self._specials_meta(),
            "add_bos": self.add_bos,
            "vocab_size": self.vocab_size,
            "sha256": self.sha256,
        }

    def __reduce__(self):
        # Rebuilt from the file bytes in the worker: no path, no shared state.
        args = (type(self), self.files, self.kind, self.eos_token, self.bos_token,
                self.pad_token, self.add_bos)  # fmt: skip
        return _rebuild, args

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size}, "
            f"eos_id={self.eos_id}, bos_id={self.bos_id}, sha256={self.sha256[:12]})"
        )

    # --- internals --------------------------------------------------------------------------

    def _resolve(self, name: str, explicit: str | None, own: str | None):
        token = explicit if explicit is not None else own
        if token is None:
            return None, None
        token_id = self.token_to_id(token)
        if token_id is None:
            # An explicit token the user named; a backend's own tokens are always present.
            raise TrainbookError(
                f"the tokenizer has no token '{token}'", where=f"tokenizer.{name}_token"
            )
        return token, token_id

    def _specials_meta(self) -> dict:
        out = {}
        for name in SPECIALS:
            token = getattr(self, f"{name}_token")
            token_id = getattr(self, f"{name}_id")
            out[name] = None if token is None else {"token": token, "id": token_id}
        return out

    def _identity(self) -> dict:
        # What decides the ids: the file contents (not how they were obtained or named on the
        # user's disk), the resolved specials and BOS placement.
        return {
            "format": self.format,
            "files": {n: hashlib.sha256(d).hexdigest() for n, d in sorted(self.files.items())},
            **self._specials_meta(),
            "add_bos": self.add_bos,
        }


def _rebuild(cls, files, kind, eos_token, bos_token, pad_token, add_bos) -> Tokenizer:
    return cls(files, kind=kind, eos_token=eos_token, bos_token=bos_token,
               pad_token=pad_token, add_bos=add_bos)  # fmt: skip


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def read_file(path: str | os.PathLike) -> bytes:
    """A tokenizer file's bytes; a missing one is an error naming `tokenizer.path`."""
    path = Path(path)
    if not path.is_file():
        raise TrainbookError(f"no tokenizer file at '{path}'", where="tokenizer.path")
    return path.read_bytes()


def backend_class(fmt: str) -> type[Tokenizer]:
    """The backend for a saved `format` (a KeyError for an unknown one): the subclasses the
    package defines (its `__init__` imports every backend module)."""
    return {c.format: c for c in Tokenizer.__subclasses__()}[fmt]
