"""`trainbook report RUN`: one self-contained HTML file of a run (monitor/html.py draws it)."""

from __future__ import annotations

from pathlib import Path

from trainbook.atomic import atomic_write_text
from trainbook.errors import TrainbookError
from trainbook.monitor.archive import load_run
from trainbook.monitor.html import report_page
from trainbook.runs import RunPaths


def report_command(run_dir: Path, out: Path | None) -> str:
    """Write the report (default RUN/report.html); returns its path. Checks come before writing."""
    run = load_run(run_dir)
    out = Path(out) if out is not None else RunPaths.of(run.path).report
    check_output(out)
    atomic_write_text(out, report_page(run))
    return str(out)


def check_output(out: Path) -> None:
    """An output file's folder must exist, and the path must not be a folder itself."""
    if out.is_dir():
        raise TrainbookError("is a directory, not a file to write", where=f"--out {out}")
    if not out.parent.is_dir():
        raise TrainbookError(f"no such directory: {out.parent}", where=f"--out {out}")
