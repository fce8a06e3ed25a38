"""The README's fenced blocks, read one way for every test that holds the README to the tool: the
tutorial run as written, the output blocks compared with what the real commands print, the
tables compared with the files they come from.

A block is found by its section (the heading above it) or by a marker, a piece of the text just
before it. A block written as a terminal session is split into its `$ command`s and what each
printed (`transcript`); `assert_printed` holds such lines to what a test's own run printed, in
order, exactly or with the numbers and run ids masked (`masked`), as each test states."""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

# A fence at the start of a line or indented under a list item; the closing fence has the same indent.
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", flags=re.S | re.M)
_HEADING = re.compile(r"^(#{1,6}) (.+)$", flags=re.M)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_RUN_ID = re.compile(r"\b\d{8}-\d{6}-[0-9a-f]{6}\b")
_RULE = re.compile(r"-{3,}")
_CUT = re.compile(r"(, )?\.\.\.[}\]]?$")  # what ends a README line that shows the start of a printed one

README_HOST = "vm"
"""The host name the README's transcripts were printed on (`host vm`, `on vm`)."""


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
    """`text` with every run directory's time and id (`20261202-021153-85b56e`) replaced by
    `<run>`, every other number (digits with any `.` or `,` inside) by `#`, and every run of
    three or more dashes (a table's rule, as wide as the figures of its column) by `---`: the
    normalisation for output whose figures vary from run to run and machine to machine."""
    return _RULE.sub("---", _NUMBER.sub("#", _RUN_ID.sub("<run>", text)))


def missing_lines(expected: list[str], output: str, *, mask: bool = False) -> list[str]:
    """The README lines `expected` that do not appear in `output` in the same order (other lines
    may lie between them; a `...` line is the README saying so, and a line ending in `...` stands
    for a printed line that begins with what comes before it, as does a JSON line ending in
    `, ...}` or `, ...]`: the keys or items shown, the rest left out); with `mask`, numbers are
    compared as `masked` writes them. An empty list means the README shows what was printed."""
    norm = masked if mask else (lambda s: s)
    printed = [norm(line.rstrip()) for line in output.splitlines()]
    missing, at = [], 0
    for line in expected:
        if line.strip() == "...":
            continue
        want = norm(line.rstrip())
        cut = _CUT.search(want)
        want = want[:cut.start()] if cut else want
        found = next((i for i in range(at, len(printed))
                      if (printed[i].startswith(want) if cut else printed[i] == want)), None)
        if found is None:
            missing.append(line)
        else:
            at = found + 1
    return missing


def _is_status(command: str) -> bool:
    return command.rstrip().endswith("echo $?")


def shown(marker: str, command: str | None = None) -> list[str]:
    """The lines of the block after `marker`; in a transcript, those printed under the first
    `$ command` that starts with `command`, less the exit status an `; echo $?` printed."""
    block = block_after(marker)
    if command is None:
        return block.lines()
    cmd, out = next((c, o) for c, o in transcript(block) if c.startswith(command))
    return out[:-1] if _is_status(cmd) and out else out


def status(marker: str, command: str) -> int:
    """The exit status the transcript after `marker` shows for `$ command ...`: printed by its
    own `; echo $?` or by the `$ echo $?` after it."""
    steps = transcript(block_after(marker))
    i = next(i for i, (c, _) in enumerate(steps) if c.startswith(command))
    if _is_status(steps[i][0]):
        return int(steps[i][1][-1])
    assert i + 1 < len(steps) and steps[i + 1][0] == "echo $?", f"README.md: no exit status shown for `{command}`"
    return int(steps[i + 1][1][-1])


def assert_printed(marker: str, output: str, *, command: str | None = None, mask: bool = False,
                   replace: dict[str, str] | None = None) -> None:
    """The README shows, in the block after `marker` (under `command` in a transcript), lines
    that `output` printed, in order: exactly, or numbers aside with `mask`. `replace` maps what
    this run printed to what the README wrote in its place (a run directory's path, say); the
    host the README ran on is written `README_HOST`, and this machine's name is read as that."""
    for printed, written in (replace or {}).items():
        output = output.replace(printed, written)
    host = re.escape(socket.gethostname())
    out = re.sub(rf'(?<=host ){host}\b|(?<=on ){host}\b|(?<="host": "){host}(?=")', README_HOST, output)
    missing = missing_lines(shown(marker, command), out, mask=mask)
    assert not missing, (f"README.md:{block_after(marker).line}: the block after {marker!r} shows lines that were "
                         "not printed:\n" + "\n".join(missing) + "\n--- printed:\n" + out[-3000:])


def fields(record: dict) -> str:
    """A JSON object one top-level key a line (`"key": value`, each value as `json.dumps` writes
    it): how a README block quotes the parts of a file such as oom/breakdown.json."""
    return "".join(f"{json.dumps(k)}: {json.dumps(v)}\n" for k, v in record.items())


def events(text: str) -> str:
    """events.jsonl's lines as the README quotes them: each record without its `time`."""
    records = (json.loads(line) for line in text.splitlines())
    return "".join(json.dumps({k: v for k, v in r.items() if k != "time"}) + "\n" for r in records)
