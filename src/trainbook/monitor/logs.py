"""Run logs: `logs/rank<R>-<YYYY-mm-dd>.log`, a new file each day, old days deleted."""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path

LOGGER_NAME = "trainbook"


class DailyFileHandler(logging.Handler):
    """Writes to the file of the record's day; on a new day, opens it and prunes old ones."""

    def __init__(self, log_dir: Path, rank: int, retention_days: int):
        super().__init__()
        self.log_dir = Path(log_dir)
        self.prefix = f"rank{rank}-"
        self.retention_days = retention_days
        self._day: str | None = None
        self._stream = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            day = dt.date.fromtimestamp(record.created).isoformat()
            if day != self._day:
                self._open(day)
            self._stream.write(self.format(record) + "\n")
            self._stream.flush()
        except Exception:
            self.handleError(record)

    def _open(self, day: str) -> None:
        if self._stream is not None:
            self._stream.close()
        self._day = day
        self._stream = open(self.log_dir / f"{self.prefix}{day}.log", "a", encoding="utf-8")
        self._prune(time.time() - self.retention_days * 86400)

    def _prune(self, cutoff: float) -> None:
        for path in self.log_dir.glob(f"{self.prefix}*.log"):
            if path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        super().close()


def setup_run_logger(log_dir: Path, rank: int, level: str, retention_days: int) -> logging.Logger:
    """The run's logger, writing to the run's log files (the console is the progress display's)."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    logger.propagate = False
    handler = DailyFileHandler(log_dir, rank, retention_days)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    return logger


def close_run_logger(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
