"""One rule for time limits in the tests, so that every limit written in them can fire.

pytest-timeout's per-test limit (`timeout` in pyproject.toml) counts the test's fixture set-up as
well as its body; a child process limit (`timeout=N` on a subprocess call or `communicate`) at or
above it could never be reached: pytest would kill the test first, without the child's output.
So every child limit written in a test is at most `CHILD_TIMEOUT_S`, and the per-test limit
leaves room for two of them (a module fixture's child and the test's own)."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import CHILD_TIMEOUT_S, REPO

LIMIT = re.compile(r"\btimeout\s*=\s*(\d+(?:\.\d+)?)\b")


def test_the_per_test_limit_leaves_room_for_two_children():
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini.get("timeout_func_only", False) is False  # the limit counts fixture set-up too
    assert float(ini["timeout"]) >= 2 * CHILD_TIMEOUT_S, (ini["timeout"], CHILD_TIMEOUT_S)


def test_every_child_limit_written_in_a_test_can_fire():
    over = [f"{path.relative_to(REPO)}:{n}: timeout={m.group(1)}"
            for path in sorted((REPO / "tests").rglob("*.py"))
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for m in LIMIT.finditer(line) if float(m.group(1)) > CHILD_TIMEOUT_S]
    assert not over, f"child limits above CHILD_TIMEOUT_S={CHILD_TIMEOUT_S} s: {over}"
