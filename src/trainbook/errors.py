"""User-facing errors: the CLI prints them as one line and exits with their code (2: bad input;
3: a failure the run diagnosed and stopped on)."""

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
    """Training stopped on a failure it diagnosed (out of memory, a hang, a non-finite loss under
    policy `stop`): the message is the one-line verdict, the evidence is in the run directory."""

    exit_code = 3


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's text on one line (library messages may span several), cut at `limit`."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
