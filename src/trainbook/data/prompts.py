"""Prompts: the records a model is asked to complete (`trainbook eval`'s `--data`, the prompts of
reinforcement learning), checked line by line, and a prompt as the ids the model reads.

A record holds `prompt`: a string (encoded as it is, as `trainbook sample` encodes one) or a list
of messages (rendered with the run's chat template and its generation prompt, as training
rendered conversations); or `messages` ending with a user turn (the same as a message-list
prompt). Its other fields are columns, which scorers and reward functions receive (`answer`, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trainbook.data.chat import ChatTemplate, check_messages, optional_template
from trainbook.data.tokenizer import Tokenizer
from trainbook.errors import TrainbookError, one_line

PROMPT_FIELD, MESSAGES_FIELD = "prompt", "messages"


@dataclass(frozen=True)
class PromptRecord:
    prompt: str | list[dict]
    """As the record gives it: a string, or messages ending with a user turn."""
    columns: dict
    """The record's other fields."""
    line: int
    file: str = ""
    """The file it was read from (a recipe's prompt source may hold several)."""

    @property
    def where(self) -> str:
        """"'FILE' line N", for errors."""
        return f"'{self.file}' line {self.line}" if self.file else f"line {self.line}"

    def text(self) -> str:
        """The prompt as plain text (messages' contents, one a line): what `prepare` tokenizes
        of a prompt source, for a tokenizer trained on the corpus and the data report."""
        return self.prompt if isinstance(self.prompt, str) else "\n".join(m["content"] for m in self.prompt)


def read_prompts(path: Path, option: str = "--data") -> list[PromptRecord]:
    """The records of JSONL file `path`, each with a prompt; a one-line error naming `option` (the
    option or recipe key that named the file), the file and the line of the first that is not one."""
    path = Path(path)
    where = f"'{path}'"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TrainbookError(f"{where}: no such file", where=option) from None
    except (OSError, UnicodeDecodeError) as e:
        raise TrainbookError(f"{where}: cannot read: {one_line(e)}", where=option) from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where} line {number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise TrainbookError(f"{at}: not valid JSON: {one_line(e)}", where=option) from None
        if not isinstance(record, dict):
            raise TrainbookError(f"{at}: expected a JSON object, got {type(record).__name__}", where=option)
        records.append(prompt_record(record, at, number, option, str(path)))
    if not records:
        raise TrainbookError(f"{where}: no records", where=option)
    return records


def prompt_record(record: dict, at: str, number: int, option: str, file: str = "") -> PromptRecord:
    """The prompt record of JSON object `record` (line `number` of `file`, `at` naming it in errors)."""
    if PROMPT_FIELD in record:
        prompt = record[PROMPT_FIELD]
        if isinstance(prompt, str):
            if not prompt:
                raise TrainbookError(f"{at}: field 'prompt' is an empty string", where=option)
        else:
            prompt = check_messages(prompt, f"{at}: field 'prompt'", option)
            _ends_with_user(prompt, f"{at}: field 'prompt'", option)
        key = PROMPT_FIELD
    elif MESSAGES_FIELD in record:
        prompt = check_messages(record[MESSAGES_FIELD], f"{at}: field 'messages'", option)
        _ends_with_user(prompt, f"{at}: field 'messages'", option)
        key = MESSAGES_FIELD
    else:
        names = ", ".join(f"'{k}'" for k in record) or "no fields"
        raise TrainbookError(f"{at}: no field 'prompt' (a string or a list of messages) or 'messages'; "
                             f"the object has {names}", where=option)
    return PromptRecord(prompt, {k: v for k, v in record.items() if k != key}, number, file)


def _ends_with_user(messages: list[dict], what: str, option: str) -> None:
    if messages[-1]["role"] != "user":
        raise TrainbookError(f"{what} ends with a message of role '{messages[-1]['role']}'; a prompt ends with the "
                             "user's turn (the completion is the assistant's answer)", where=option)


def columns_of(records: list[PromptRecord], repeat: int = 1) -> dict[str, list]:
    """Each field of the records (but the prompt) as a list, every record's value `repeat` times
    in a row (None where a record lacks the field): the scorer's keyword arguments."""
    names = list(dict.fromkeys(k for r in records for k in r.columns))
    return {name: [r.columns.get(name) for r in records for _ in range(repeat)] for name in names}


class PromptEncoder:
    """A prompt as the run's model reads it: a string encoded as `trainbook sample` encodes one;
    messages rendered by the run's chat template with the generation prompt (the ids training
    saw before an assistant turn). `stop_ids`: the tokenizer's EOS and the template's end of turn."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, template_problem: str | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self._template_problem = template_problem
        self.stop_ids = {tokenizer.eos_id} | ({self._end_of_turn()} - {None} if template else set())

    @classmethod
    def of_run(cls, cfg, tokenizer: Tokenizer) -> PromptEncoder:
        try:
            found = optional_template(cfg.tokenizer)
        except TrainbookError as e:
            return cls(tokenizer, None, str(e))
        if found is None:
            return cls(tokenizer, None, "the run has no chat template (tokenizer.chat_template)")
        return cls(tokenizer, ChatTemplate(found[0], found[1], bos_token=tokenizer.bos_token,
                                           eos_token=tokenizer.eos_token))

    def ids(self, prompt: str | list[dict], where: str = "--data", option: str = "--data") -> list[int]:
        """The prompt's ids; `where` names the record in an error, `option` the option or recipe key."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if self.template is None:
            raise TrainbookError(f"{where}: a list of messages needs a chat template: {self._template_problem}",
                                 where=option)
        text = self.template.render(prompt, add_generation_prompt=True)
        return self.tokenizer.encode_offsets(text, specials=True)[0]

    def _end_of_turn(self) -> int | None:
        """The special token the template writes right after an assistant message's text, if any
        (ChatML's <|im_end|>, Llama 3's <|eot_id|>)."""
        text = "Hello"
        try:  # a template that wants other turns, a tokenizer without offsets: no such token known
            rendered = self.template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}])
            after = rendered[rendered.rfind(text) + len(text):]
            ids = self.tokenizer.encode_offsets(after, specials=True)[0] if after.strip() else []
        except TrainbookError:
            return None
        if not ids:
            return None
        first = self.tokenizer.decode(ids[:1])
        return ids[0] if first in self.tokenizer.special_strings() else None
