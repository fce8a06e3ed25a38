"""User-facing errors: the CLI prints them as one line and exits with their code.

Exit codes (a contract: orchestrators and scripts branch on them):

| code | meaning |
|---|---|
| 0 | done (or every step to `train.max_steps` already trained) |
| 1 | an unexpected error: a bug or a failure nothing diagnosed (the traceback is in the log) |
| 2 | bad input: recipe, data or command line (one line naming the file and key) |
| 3 | out of memory, diagnosed (the breakdown is in events.jsonl) |
| 4 | a hang or a dead peer, diagnosed by the watchdog (`hang/`) |
| 5 | a non-finite loss or a loss spike stopped by triage (`incidents/step-N/`) |
| 6 | elastic restarts exhausted: the same failure repeated (`restart` events) |
| 128+N | stopped by signal N after a checkpoint (143: SIGTERM, 130: SIGINT) |
"""

from __future__ import annotations


class TrainbookError(Exception):
    """A problem with the user's input (recipe, data, command line), not a bug.

    `where` names the file and/or key path the problem is in; `str()` gives the one line the
    CLI prints: ``recipes/x.toml: train.max_steps: must be > 0``.
    """

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class DiagnosedFailure(TrainbookError):
    """Training stopped on a failure it diagnosed: the message is the one-line verdict, the
    evidence is in the run directory. The subclass names the kind, and so the exit code."""

    exit_code = 3  # out of memory: the first diagnosis trainbook had, and its code


class HangFailure(DiagnosedFailure):
    """No rank advanced for `parallel.hang_timeout_s` (a hung collective, a stopped or dead peer)."""

    exit_code = 4


class NonFiniteFailure(DiagnosedFailure):
    """Triage stopped the run on a non-finite loss or gradient, or a loss spike (policy `stop`)."""

    exit_code = 5


class RepeatedFailure(DiagnosedFailure):
    """The elastic agent's restarts are spent: the run failed again after each of them."""

    exit_code = 6


DIAGNOSED = {cls.__name__: cls for cls in (DiagnosedFailure, HangFailure, NonFiniteFailure, RepeatedFailure)}
"""Diagnosed failures by name: an `end` event's `error` starts with one of them."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's text on one line (library messages may span several), cut at `limit`."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
