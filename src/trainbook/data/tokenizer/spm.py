"""SentencePiece backend (a `.model` file, e.g. Llama/Mistral's).

The model's own specials are its `eos_id()`, `bos_id()`, `pad_id()` (an id < 0 means none).
SentencePiece matches control symbols ("<s>", "</s>") only by id, never in text, so a literal
"</s>" in a document stays text. Round trip: `decode(encode(x)) == x` holds up to the model's
normaliser (Llama's is the identity on ordinary text; NFKC models are not).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import sentencepiece

from trainbook.data.tokenizer.base import Tokenizer, read_file
from trainbook.errors import TrainbookError, one_line

FILE = "tokenizer.model"


class SentencePieceTokenizer(Tokenizer):
    format = "sentencepiece"

    @staticmethod
    def read_source(path: str | os.PathLike) -> dict[str, bytes]:
        return {FILE: read_file(path)}

    def _parse(self, files: dict[str, bytes], where: str) -> None:
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=files[FILE])
        except Exception as e:  # RuntimeError with the protobuf parser's message
            raise TrainbookError(
                f"not a SentencePiece model: {one_line(e)}", where=where
            ) from e

    def _vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def _own_specials(self):
        ids = (self._sp.eos_id(), self._sp.bos_id(), self._sp.pad_id())
        return tuple(self._sp.id_to_piece(i) if i >= 0 else None for i in ids)

    def _eos_candidates(self) -> str:
        return "the model's eos_id"

    def token_to_id(self, token: str) -> int | None:
        # piece_to_id answers unk_id for a piece it does not have.
        i = self._sp.piece_to_id(token)
        if i == self._sp.unk_id() and self._sp.id_to_piece(i) != token:
            return None
        return i

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(list(ids))
