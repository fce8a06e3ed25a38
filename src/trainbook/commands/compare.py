"""`trainbook compare RUN_A RUN_B ...`: config differences, who is ahead, curves overlaid."""

from __future__ import annotations

from pathlib import Path

from trainbook.atomic import atomic_write_text
from trainbook.commands.report import check_output
from trainbook.errors import TrainbookError
from trainbook.monitor.archive import load_run
from trainbook.monitor.compare import compare_text, run_labels
from trainbook.monitor.html import compare_page


def compare_command(run_dirs: list[Path], out: Path | None) -> str:
    """Write the comparison page (default ./compare.html); returns the terminal text."""
    if len(run_dirs) < 2:
        raise TrainbookError("compare needs at least two run directories", where="command line")
    runs = [load_run(p) for p in run_dirs]
    out = Path(out) if out is not None else Path("compare.html")
    check_output(out)
    atomic_write_text(out, compare_page(runs))
    return compare_text(runs, run_labels(runs), str(out))
