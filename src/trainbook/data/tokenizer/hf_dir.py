"""Hugging Face tokenizer folders. In: the tokenizer of a model directory (`model.init_from =
"hf:PATH"`) as `[tokenizer]` settings (which file, which kind, which special tokens, whether BOS is
prepended). Out: an exported `tokenizer.json` made to add what the run's tokenizer adds."""

from __future__ import annotations

import json
from pathlib import Path

from trainbook.errors import TrainbookError, one_line

CONFIG_FILE = "config.json"
TOKENIZER_JSON, SP_MODEL, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer.model", "tokenizer_config.json"


def hf_tokenizer_config(path: Path) -> dict:
    """`[tokenizer]` settings (TokenizerConfig fields) for the tokenizer of HF directory `path`.

    `tokenizer.json` -> kind "hf" (preferred when both are there: it is what transformers runs),
    else `tokenizer.model` -> kind "sentencepiece". Specials: `tokenizer_config.json`'s
    `{eos,bos,pad}_token`, else `config.json`'s `*_token_id` looked up in the tokenizer; one
    found neither way, or naming a token the tokenizer lacks, is left out (the tokenizer's own
    then applies).

    `add_bos`: whether transformers' tokenizer prepends BOS under its default
    `add_special_tokens=True`. For `tokenizer.json` its post-processor decides (transformers 5
    ignores `add_bos_token` for such files); for `tokenizer.model`, `add_bos_token` in
    tokenizer_config.json, true by default as transformers' LlamaTokenizer documents. So for
    tokenizer.json trainbook's ids equal transformers' with its defaults, except that trainbook
    adds no other special token (a post-processor's trailing EOS): packing puts EOS between
    documents. A tokenizer.model is encoded by sentencepiece itself, which differs from
    transformers' conversion of it on spaces (README, "Precision and pretrained weights").
    """
    path = Path(path)
    if (path / TOKENIZER_JSON).is_file():
        kind, file = "hf", path / TOKENIZER_JSON
    elif (path / SP_MODEL).is_file():
        kind, file = "sentencepiece", path / SP_MODEL
    else:
        raise TrainbookError(f"no tokenizer: neither {TOKENIZER_JSON} nor {SP_MODEL}", where=str(path))
    vocab = _Vocab(kind, file)
    tok_config = _optional_json(path / TOKENIZER_CONFIG)
    model_config = _optional_json(path / CONFIG_FILE)
    settings: dict = {"kind": kind, "path": str(file)}
    for name in ("eos", "bos", "pad"):
        token = _token_text(tok_config.get(f"{name}_token"))
        if token is None:
            token_id = model_config.get(f"{name}_token_id")
            if isinstance(token_id, list):  # e.g. Llama 3.1 Instruct's several EOS ids
                token_id = token_id[0] if token_id else None
            token = vocab.id_to_token(token_id) if isinstance(token_id, int) else None
        if token is not None and vocab.token_to_id(token) is not None:
            settings[f"{name}_token"] = token
    bos = settings.get("bos_token")
    if kind == "hf":
        settings["add_bos"] = bos is not None and vocab.prepends(bos)
    else:
        settings["add_bos"] = bos is not None and bool(tok_config.get("add_bos_token", True))
    return settings


class _Vocab:
    """The few look-ups `hf_tokenizer_config` needs, over either library."""

    def __init__(self, kind: str, file: Path):
        try:
            if kind == "hf":
                import tokenizers

                self._hf = tokenizers.Tokenizer.from_file(str(file))
            else:
                import sentencepiece

                self._sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
        except Exception as e:  # both libraries raise plain Exception/RuntimeError when parsing
            raise TrainbookError(f"not a readable tokenizer: {one_line(e)}", where=str(file)) from None
        self.kind = kind

    def id_to_token(self, i: int) -> str | None:
        if self.kind == "hf":
            return self._hf.id_to_token(i)
        return self._sp.id_to_piece(i) if 0 <= i < self._sp.get_piece_size() else None

    def token_to_id(self, token: str) -> int | None:
        if self.kind == "hf":
            return self._hf.token_to_id(token)
        i = self._sp.piece_to_id(token)  # unk_id for a piece it does not have
        return None if i == self._sp.unk_id() and self._sp.id_to_piece(i) != token else i

    def prepends(self, token: str) -> bool:
        """True when encoding with the post-processor's specials puts `token` first."""
        plain = self._hf.encode("a", add_special_tokens=False).ids
        full = self._hf.encode("a", add_special_tokens=True).ids
        return full[:1] == [self.token_to_id(token)] and plain[:1] != full[:1]


def _token_text(value) -> str | None:
    # tokenizer_config.json writes a special as a string, or as an AddedToken object.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _optional_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise TrainbookError(f"not valid JSON: {e}", where=str(file)) from None
    return data if isinstance(data, dict) else {}


def match_post_processor(file: Path, bos: dict | None) -> bool:
    """Rewrite tokenizer.json `file` so that transformers' default encoding (add_special_tokens
    on) adds what the run's tokenizer adds: `bos` ({"token", "id"}) first, or nothing. That is
    the post-processor's job alone (transformers 5 ignores tokenizer_config.json's add_bos_token
    when there is a tokenizer.json). Returns whether the file changed; a file that already adds
    exactly that is left as it is."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(file))
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    if full == ([bos["id"]] if bos else []) + plain:
        return False
    if bos is None:
        tok.post_processor = None
    else:
        # BOS before each sequence, as packing puts it before each document.
        template = processors.TemplateProcessing(
            single=f"{bos['token']} $A", pair=f"{bos['token']} $A {bos['token']}:1 $B:1",
            special_tokens=[(bos["token"], bos["id"])],
        )
        # A post-processor that adds no token (ByteLevel's offset trimming) is kept before it.
        keep = tok.post_processor is not None and full == plain
        tok.post_processor = processors.Sequence([tok.post_processor, template]) if keep else template
    file.write_text(tok.to_str(), encoding="utf-8")
    return True
