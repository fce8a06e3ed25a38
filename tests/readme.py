"""The README's fenced blocks, read one way for every test that holds the README to the tool: the
tutorial run as written, the output blocks compared with what the real commands print, the
tables compared with the files they come from.

A block is found by its section (the heading above it) or by a marker, a piece of the text just
before it; output is compared line by line, exactly or with the numbers masked (`masked`), as
each test states."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

# A fence at the start of a line or indented under a list item; the closing fence has the same indent.
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", flags=re.S | re.M)
_HEADING = re.compile(r"^(#{1,6}) (.+)$", flags=re.M)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language (`""` for a plain one), its text (dedented to its fence)
    and the 1-based line of its opening fence."""

    lang: str
    text: str
    line: int

    def lines(self) -> list[str]:
        return self.text.splitlines()


def readme() -> str:
    return README.read_text(encoding="utf-8")


def _blocks_in(text: str, first_line: int) -> list[Block]:
    found = []
    for m in _FENCE.finditer(text):
        indent = len(m.group("indent"))
        body = "".join(line[indent:] if line[:indent].strip() == "" else line
                       for line in m.group("body").splitlines(keepends=True))
        found.append(Block(m.group("lang"), body, first_line + text.count("\n", 0, m.start())))
    return found


def section(heading: str) -> tuple[str, int]:
    """The text under `heading` (e.g. ``"## Your data, your model"``) up to the next heading of
    the same or a higher level, and the line it starts on."""
    text = readme()
    start = text.index(f"\n{heading}\n") + 1
    level = len(heading) - len(heading.lstrip("#"))
    fenced = [m.span() for m in _FENCE.finditer(text)]  # a `# comment` in a block is no heading
    end = len(text)
    for m in _HEADING.finditer(text, start + len(heading)):
        if len(m.group(1)) <= level and not any(a <= m.start() < b for a, b in fenced):
            end = m.start()
            break
    return text[start:end], 1 + text.count("\n", 0, start)


def blocks(heading: str | None = None) -> list[Block]:
    """The fenced blocks of the whole README, or of the section under `heading`, in order."""
    text, first = section(heading) if heading else (readme(), 1)
    return _blocks_in(text, first)


def block_after(marker: str) -> Block:
    """The first fenced block after the first occurrence of `marker` in the README (the marker
    must occur once, so that a test cannot silently read another block)."""
    text = readme()
    assert text.count(marker) == 1, f"README.md: {marker!r} occurs {text.count(marker)} times, not once"
    at = text.index(marker)
    following = [b for b in _blocks_in(text, 1) if b.line > 1 + text.count("\n", 0, at)]
    assert following, f"README.md: no fenced block after {marker!r}"
    return following[0]


def table_after(marker: str) -> list[list[str]]:
    """The cells of the first markdown table after `marker` (which must occur once), its header
    row first; the `|---|` row is left out, an escaped `\\|` stays inside its cell."""
    text = readme()
    assert text.count(marker) == 1, f"README.md: {marker!r} occurs {text.count(marker)} times, not once"
    rest = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(rest) if line.startswith("|"))
    rows = []
    for line in rest[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not all(set(c) <= set("-: ") for c in cells):
            rows.append(cells)
    return rows


def transcript(block: Block) -> list[tuple[str, list[str]]]:
    """A block written as a terminal session: each `$ command` (continued with a trailing `\\`)
    and the lines printed after it, up to the next command. A `...` line stands for lines left
    out and is kept, for `shows` to skip."""
    steps: list[tuple[str, list[str]]] = []
    lines = iter(block.lines())
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                command = command[:-1].rstrip() + " " + next(lines).strip()
            steps.append((command, []))
        else:
            assert steps, f"README.md:{block.line}: output before the first `$ ` command: {line!r}"
            steps[-1][1].append(line)
    return steps


def masked(text: str) -> str:
    """`text` with every number (digits with any `.` or `,` inside) replaced by `#`: the
    normalisation for output whose figures vary from run to run and machine to machine."""
    return _NUMBER.sub("#", text)


def missing_lines(expected: list[str], output: str, *, mask: bool = False) -> list[str]:
    """The README lines `expected` that do not appear in `output` in the same order (other lines
    may lie between them; a `...` line is the README saying so); with `mask`, numbers are
    compared as `masked` writes them. An empty list means the README shows what was printed."""
    norm = masked if mask else (lambda s: s)
    printed = [norm(line.rstrip()) for line in output.splitlines()]
    missing, at = [], 0
    for line in expected:
        if line.strip() == "...":
            continue
        want = norm(line.rstrip())
        try:
            at = printed.index(want, at) + 1
        except ValueError:
            missing.append(line)
    return missing
