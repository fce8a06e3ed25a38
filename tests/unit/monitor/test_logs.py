import logging
import os
import time

from trainbook.monitor.logs import DailyFileHandler


def _record(message: str, created: float) -> logging.LogRecord:
    record = logging.LogRecord("trainbook", logging.INFO, __file__, 1, message, None, None)
    record.created = created
    return record


def test_one_file_per_day_and_old_days_pruned(tmp_path):
    stale = tmp_path / "rank0-2000-01-01.log"
    stale.write_text("old\n")
    os.utime(stale, (time.time() - 40 * 86400,) * 2)
    other_rank = tmp_path / "rank1-2000-01-01.log"
    other_rank.write_text("old\n")
    os.utime(other_rank, (time.time() - 40 * 86400,) * 2)

    handler = DailyFileHandler(tmp_path, rank=0, retention_days=30)
    day1 = time.mktime((2026, 11, 29, 23, 59, 0, 0, 0, -1))
    handler.emit(_record("before midnight", day1))
    handler.emit(_record("after midnight", day1 + 120))
    handler.close()

    assert (tmp_path / "rank0-2026-11-29.log").read_text() == "before midnight\n"
    assert (tmp_path / "rank0-2026-11-30.log").read_text() == "after midnight\n"
    assert not stale.exists()  # past retention
    assert other_rank.exists()  # another rank's files are its own
