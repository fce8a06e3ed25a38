"""Chat data: conversations rendered by the model's chat template, and which tokens are trained.

A record of a `chat` source is a list of messages (`{role, content}`, roles system, user,
assistant, tool); one of a `prompt_completion` source is a prompt and a completion, both strings
(joined as written, no template) or both message lists (rendered like a conversation, the
completion's assistant turns trained). Records are checked where they are read (`check_messages`,
an error names the file and line) and carried through cleaning-free deduplication and the split
as one canonical JSON document (`chat_document`).

The template is Hugging Face's: a jinja2 text from `tokenizer_config.json`'s `chat_template`, or
a file (`tokenizer.chat_template`). It is rendered in jinja2's immutable sandbox, so a template
cannot call into Python or change its inputs; `raise_exception` and `tojson` are there as
transformers defines them, and no clock (`strftime_now` is undefined, so a template falls back
to its own fixed date and a rendering never depends on the day it was prepared).

Which characters are trained, two ways:
- A template with `{% generation %}...{% endgeneration %}` marks them itself (TRL's and
  transformers' `return_assistant_tokens_mask` read the same markers).
- Otherwise turn by turn: assistant turn k spans from the end of the conversation before it
  rendered with the generation prompt to the end of the conversation up to and including it,
  whitespace after its end-of-turn token left out. That holds only for a template whose
  rendering of a conversation begins with its rendering of every shorter one (ChatML, Llama 3);
  one that renders a turn differently once others follow (Qwen3's, which drops earlier turns'
  reasoning) is refused, naming the template and the turn, instead of training the wrong tokens.

A token is trained when any of its characters is (transformers' rule), so the labels equal
`apply_chat_template(..., return_assistant_tokens_mask=True)`'s. Special-token strings are
control tokens only where the template wrote them: a message whose content spells one is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING
from pathlib import Path

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trainbook.config.data import DataConfig, TokenizerConfig
from trainbook.errors import TrainbookError, one_line
from trainbook.pkgpath import expand_path

if TYPE_CHECKING:
    from trainbook.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
CHAT_FORMATS = ("chat", "prompt_completion")
TOKENIZER_CONFIG = "tokenizer_config.json"

# Bits of a token's mask byte (prepare writes one byte per token beside its id, shards.py).
TRAINED = 1  # an assistant turn's or the completion's token
LAST = 2  # the last assistant turn's
DOC_START = 4  # the first token of a document: no label crosses into it

CHAT_FORMAT = 1
"""Bumped when the same records and template would give other ids or masks (prepare's cache key)."""


def text_bits(length: int) -> np.ndarray:
    """The mask bytes of a text document of `length` tokens (its EOS included): all trained."""
    bits = np.full(length, TRAINED | LAST, dtype=np.uint8)
    bits[0] |= DOC_START
    return bits


# Private-use characters around a `{% generation %}` block's output while rendering.
_OPEN, _CLOSE = "\ue000", "\ue001"
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def check_messages(value: object, what: str, where: str) -> list[dict]:
    """`value` as a list of `{role, content}` messages (other keys dropped), or a one-line error;
    `what` names the record ("'chat.jsonl' line 3: field 'messages'")."""
    if not isinstance(value, list) or not value:
        kind = "an empty list" if value == [] else type(value).__name__
        raise TrainbookError(f"{what} is {kind}, not a list of messages", where=where)
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise TrainbookError(f"{what}[{i}] is {type(message).__name__}, not an object", where=where)
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise TrainbookError(f"{what}[{i}]: role {role!r} is not one of {', '.join(ROLES)}", where=where)
        if not isinstance(content, str):
            raise TrainbookError(f"{what}[{i}]: content is {type(content).__name__}, not a string", where=where)
        if re.search("[\ud800-\udfff]", content):
            raise TrainbookError(f"{what}[{i}]: content is not valid UTF-8 (a lone surrogate escape)", where=where)
        if _OPEN in content or _CLOSE in content:
            raise TrainbookError(f"{what}[{i}]: content holds U+E000 or U+E001 (reserved while rendering)",
                                 where=where)
        out.append({"role": role, "content": content})
    return out


def chat_document(messages: list[dict], completion_from: int | None = None) -> str:
    """The canonical JSON document of a conversation (the completion's first message index, for a
    conversational prompt_completion record)."""
    record = {"messages": messages} if completion_from is None else {"messages": messages,
                                                                     "completion_from": completion_from}
    return json.dumps(record, ensure_ascii=False, sort_keys=True)


def text_pair_document(prompt: str, completion: str) -> str:
    """The canonical JSON document of a string prompt_completion record."""
    return json.dumps({"prompt": prompt, "completion": completion}, ensure_ascii=False, sort_keys=True)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: the block's output between private-use marks,
    found and removed after rendering (`ChatTemplate.render_marked`)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return _OPEN + caller() + _CLOSE


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def template_source(chat_template: str | None, tokenizer_path: str | None) -> tuple[str, str]:
    """(template text, what to call it in errors) from `tokenizer.chat_template` or the
    `tokenizer_config.json` beside `tokenizer.path`."""
    if chat_template is not None:
        path = Path(expand_path(chat_template, "tokenizer.chat_template"))
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise TrainbookError(f"cannot read '{path}': {one_line(e)}", where="tokenizer.chat_template") from e
    if tokenizer_path is None:
        raise TrainbookError("chat data needs a chat template: set tokenizer.chat_template to a jinja file",
                             where="tokenizer.chat_template")
    folder = Path(expand_path(tokenizer_path, "tokenizer.path"))
    config = (folder if folder.is_dir() else folder.parent) / TOKENIZER_CONFIG
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    if isinstance(template, list):  # transformers' named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str):
        raise TrainbookError(f"'{config}' has no chat_template; set tokenizer.chat_template to a jinja file",
                             where="tokenizer.chat_template")
    return template, f"{config} (chat_template)"


@dataclass(frozen=True)
class Rendered:
    text: str
    spans: list[tuple[int, int]]
    """Character ranges trained, one per trained turn, in order."""


class ChatTemplate:
    """A chat template, compiled once in the sandbox; `name` says which in every error."""

    def __init__(self, source: str, name: str, *, bos_token: str | None = None, eos_token: str | None = None):
        self.name = name
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TrainbookError(f"chat template {name} does not parse: {one_line(e)}",
                                 where="tokenizer.chat_template") from e
        self.marked = bool(_GENERATION_TAG.search(source))
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render_marked(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, **self._specials)
        except jinja2.TemplateError as e:  # raise_exception, a sandbox refusal, an undefined call
            raise TrainbookError(f"chat template {self.name}: {one_line(e)}", where="tokenizer.chat_template") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.render_marked(messages, add_generation_prompt).replace(_OPEN, "").replace(_CLOSE, "")

    def spans(self, messages: list[dict], first: int = 0) -> Rendered:
        """The rendering and the trained spans of the assistant turns at index >= `first`."""
        if self.marked:
            return self._marked_spans(messages, first)
        full = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant" or k < first:
                continue
            before = self.render(messages[:k], add_generation_prompt=True)
            through = self.render(messages[: k + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise TrainbookError(
                    f"chat template {self.name} renders message {k} (assistant) differently once later messages "
                    "follow, so its tokens cannot be found turn by turn; give the template {% generation %} "
                    "markers (tokenizer.chat_template = a file)", where="tokenizer.chat_template")
            end = len(through.rstrip())
            if end <= len(before):  # the turn renders as nothing (or whitespace): no token to train
                raise TrainbookError(f"chat template {self.name} renders message {k} (assistant) as no text, so "
                                     "there is nothing to train", where="tokenizer.chat_template")
            spans.append((len(before), end))
        if not spans:
            raise TrainbookError(f"chat template {self.name} leaves no assistant text to train in a conversation "
                                 f"of roles {[m['role'] for m in messages]}", where="tokenizer.chat_template")
        return Rendered(full, spans)

    def _marked_spans(self, messages: list[dict], first: int) -> Rendered:
        marked = self.render_marked(messages)
        text, spans, opened = [], [], None
        length = 0
        for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
            if piece == _OPEN:
                opened = length
            elif piece == _CLOSE and opened is not None:
                spans.append((opened, length))
                opened = None
            elif piece:
                text.append(piece)
                length += len(piece)
        if first:  # prompt_completion: the completion's turns are the last ones the template marked
            keep = sum(1 for m in messages[first:] if m["role"] == "assistant")
            spans = spans[len(spans) - keep:]
        spans = [s for s in spans if s[1] > s[0]]
        if not spans:
            raise TrainbookError(f"chat template {self.name}'s {{% generation %}} markers enclose no text in a "
                                 f"conversation of roles {[m['role'] for m in messages]}",
                                 where="tokenizer.chat_template")
        return Rendered("".join(text), spans)


def token_bits(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """The mask byte of each token (`TRAINED`, `LAST`, `DOC_START`) from its character range:
    trained when any character of it lies in a span."""
    bits = np.zeros(len(offsets), dtype=np.uint8)
    if not len(offsets):
        return bits
    starts = np.array([a for a, _ in offsets], dtype=np.int64)
    ends = np.array([b for _, b in offsets], dtype=np.int64)
    for i, (lo, hi) in enumerate(spans):
        inside = (starts < hi) & (ends > lo)
        bits[inside] |= TRAINED | (LAST if i == len(spans) - 1 else 0)
    bits[0] |= DOC_START
    return bits


class ChatEncoder:
    """Documents of chat sources -> (token ids, mask bytes), by one template and tokenizer."""

    def __init__(self, template: ChatTemplate | None, tokenizer):
        self.template = template
        self.tokenizer = tokenizer

    def encode(self, document: str, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask bytes) of one document, EOS appended as for every document (prepare.py).
        A string completion's EOS is trained (the model learns to stop); after a rendered
        conversation it is not: the template's end-of-turn token already is. `where`: the
        source's key, for errors about the record."""
        tok = self.tokenizer
        record = json.loads(document)
        if "prompt" in record:  # a string prompt and completion, joined as written
            text = record["prompt"] + record["completion"]
            ids, offsets = tok.encode_offsets(text, specials=False)
            bits = token_bits(offsets, [(len(record["prompt"]), len(text))])
            eos_bits = TRAINED | LAST
        else:
            if self.template is None:
                raise TrainbookError("chat data needs a chat template", where="tokenizer.chat_template")
            messages = record["messages"]
            self._refuse_specials(messages, where)
            rendered = self.template.spans(messages, record.get("completion_from", 0))
            ids, offsets = tok.encode_offsets(rendered.text, specials=True)
            bits, eos_bits = token_bits(offsets, rendered.spans), 0
        return np.array([*ids, tok.eos_id], dtype=np.int64), np.append(bits, np.uint8(eos_bits))

    def _refuse_specials(self, messages: list[dict], where: str) -> None:
        specials = self.tokenizer.special_strings()
        for m in messages:
            found = next((s for s in specials if s in m["content"]), None)
            if found is not None:
                snippet = m["content"][:40].replace("\n", " ")
                raise TrainbookError(
                    f"a {m['role']} message spells the special token {found!r} "
                    f"(\"{snippet}...\"); in a template's rendering it would be a control token, not text",
                    where=where)


def has_chat(data: DataConfig) -> bool:
    """Whether any source is conversations (a template and mask shards are needed)."""
    return any(s.format in CHAT_FORMATS for s in data.sources)


def optional_template(tok: TokenizerConfig) -> tuple[str, str] | None:
    """(template text, where it came from), or None when the tokenizer has none and none is named."""
    try:
        return template_source(tok.chat_template, tok.path)
    except TrainbookError:
        if tok.chat_template is not None:  # a file named but not readable
            raise
        return None


def chat_encoder(data: DataConfig, tok: TokenizerConfig, tokenizer: Tokenizer) -> ChatEncoder:
    """The encoder of chat documents: the recipe's template and the tokenizer. Without a
    template only string prompt_completion records can be encoded: a `chat` source is refused
    here, before any record is read; a conversational prompt_completion record, when met."""
    found = optional_template(tok)
    if found is None and any(s.format == "chat" for s in data.sources):
        template_source(tok.chat_template, tok.path)  # raises: why there is none, and what to set
    template = None if found is None else ChatTemplate(found[0], found[1], bos_token=tokenizer.bos_token,
                                                       eos_token=tokenizer.eos_token)
    return ChatEncoder(template, tokenizer)
