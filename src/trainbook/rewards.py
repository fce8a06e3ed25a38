"""Built-in scorers for `trainbook eval --scorer trainbook.rewards:NAME` (and the rewards of
reinforcement learning, which calls them the same way).

A scorer is any importable function `fn(prompts, completions, **columns) -> list[float]`: one
score per completion, where `prompts[i]` is the prompt completion `i` answers (a string or a list
of messages, as the record gave it) and each column is one of the records' other fields, a list
aligned with the completions. A score >= 1 counts as correct in the accuracy `eval` reports.

Scorers take what they need by name and swallow the rest (`**_`), so one data file can feed
several. Nothing of trainbook is imported here: a scorer runs wherever its inputs are.
"""

from __future__ import annotations

import re

# An optionally signed integer or decimal, thousands separators allowed ("1,234.5").
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text`, as written but without separators ("1,024." -> "1024"),
    or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _same_number(written: str, answer: object) -> bool:
    expected = str(answer).strip().replace(",", "")
    if written == expected:
        return True
    try:  # "7.0" against 7, "007" against "7": the same number
        return float(written) == float(expected)
    except ValueError:
        return False


def exact_answer(prompts: list, completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the last number in the completion equals the record's `answer` (a number or a
    string holding one), else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        written = last_number(completion)
        scores.append(1.0 if written is not None and _same_number(written, expected) else 0.0)
    return scores


def has_number(prompts: list, completions: list[str], **_) -> list[float]:
    """1.0 where the completion writes a number at all (a format check), else 0.0."""
    return [1.0 if last_number(c) is not None else 0.0 for c in completions]
