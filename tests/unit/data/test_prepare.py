from __future__ import annotations

import numpy as np
import pytest

from trainbook.config.schema import DataConfig, SourceConfig, TokenizerConfig
from trainbook.data import Prepared, prepare
from trainbook.data.prepare import split_documents
from trainbook.data.shards import read_index, verify_shard
from trainbook.data.sources import markdown_to_text
from trainbook.errors import TrainbookError

from .conftest import EOS

TOK = TokenizerConfig(vocab_size=300)


@pytest.fixture
def corpus(write_files, hamlet):
    """Ten distinct documents (slices of Hamlet) in two sources: 7 text files, 3 markdown."""
    pieces = [hamlet[i * 1500 : (i + 1) * 1500].strip() for i in range(10)]
    text = write_files({f"t{i}.txt": pieces[i] for i in range(7)}, under="text")
    markdown = write_files(
        {f"m{i}.md": "**KING**  \n" + pieces[7 + i] for i in range(3)}, under="md"
    )
    return text, markdown


def _data(tmp_path, text, markdown, **overrides) -> DataConfig:
    fields = dict(
        sources=[
            SourceConfig(name="text", paths=[f"{text}/*.txt"]),
            SourceConfig(name="plays", paths=[f"{markdown}/*.md"], format="markdown"),
        ],
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.2,
        shard_tokens=1024,
    )
    return DataConfig(**(fields | overrides))


def _documents_of(stream, tokenizer) -> list[str]:
    """Cut a packed stream at EOS and decode each document."""
    ids = stream.read(0, len(stream))
    ends = np.flatnonzero(ids == tokenizer.eos_id)
    assert len(ids) == 0 or ends[-1] == len(ids) - 1  # EOS after every document, the last too
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e]) for s, e in zip(starts, ends, strict=True)]


def test_prepare_end_to_end(tmp_path, corpus):
    messages = []
    prepared = prepare(_data(tmp_path, *corpus), TOK, seed=0, log=messages.append)
    assert isinstance(prepared, Prepared) and not prepared.cached
    assert any(m.startswith("tokenizing 10 documents") for m in messages)

    manifest, tok = prepared.manifest, prepared.tokenizer
    assert (prepared.dir / "manifest.json").is_file() and (
        prepared.dir / "tokenizer.json"
    ).is_file()
    assert manifest["tokenizer"]["sha256"] == tok.sha256 and manifest["tokenizer"]["eos_id"] == 0
    assert manifest["key"].startswith(prepared.dir.name)

    # 10 documents, 20% held out: 8 train, 2 val, split by whole documents.
    splits = manifest["splits"]
    assert (splits["train"]["documents"], splits["val"]["documents"]) == (8, 2)
    originals = [p.read_text() for p in sorted(corpus[0].glob("*.txt"))]
    originals += [markdown_to_text(p.read_text()).rstrip() for p in sorted(corpus[1].glob("*.md"))]
    assert all(d.startswith("KING:\n") for d in originals[7:])
    train_docs = _documents_of(prepared.train, tok)
    val_docs = _documents_of(prepared.val, tok)
    assert len(train_docs) == 8 and len(val_docs) == 2
    assert sorted(train_docs + val_docs) == sorted(originals)  # every document whole, once
    assert train_docs == [d for d in originals if d not in val_docs]  # corpus order kept

    # Token counts: each document's tokens plus its EOS, per split and per source.
    for split, stream, docs in (
        ("train", prepared.train, train_docs),
        ("val", prepared.val, val_docs),
    ):
        expected = sum(len(tok.encode(d)) + 1 for d in docs)
        assert splits[split]["tokens"] == len(stream) == expected
    by_source = {s["name"]: s for s in manifest["sources"]}
    assert by_source["text"]["files"] == 7 and by_source["plays"]["files"] == 3
    for split in ("train", "val"):
        assert sum(s["tokens"][split] for s in by_source.values()) == splits[split]["tokens"]
        assert sum(s["documents"][split] for s in by_source.values()) == splits[split]["documents"]

    shard_files = {
        f"{n[:-4]}{ext}"
        for s in ("train", "val")
        for n in splits[s]["shards"]
        for ext in (".bin", ".json")
    }
    assert {p.name for p in prepared.dir.iterdir()} == {
        "manifest.json",
        "tokenizer.json",
    } | shard_files

    # More tokens than shard_tokens: several shards, each verified, each <= 1024 tokens.
    assert len(splits["train"]["shards"]) > 1
    for name in splits["train"]["shards"] + splits["val"]["shards"]:
        verify_shard(prepared.dir / name)
        assert read_index(prepared.dir / name)["tokens"] <= 1024


def test_second_prepare_is_cached_and_tokenizes_nothing(tmp_path, corpus):
    data = _data(tmp_path, *corpus)
    first = prepare(data, TOK, seed=0)
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.dir.iterdir()}
    messages = []
    second = prepare(data, TOK, seed=0, log=messages.append)
    assert second.cached and second.dir == first.dir and second.manifest == first.manifest
    assert not any("tokeniz" in m for m in messages)
    assert {p.name: p.stat().st_mtime_ns for p in second.dir.iterdir()} == mtimes
    assert second.tokenizer.sha256 == first.tokenizer.sha256
    np.testing.assert_array_equal(second.train.read(0, 500), first.train.read(0, 500))


def test_key_changes_with_file_content_and_relevant_settings(tmp_path, corpus):
    data = _data(tmp_path, *corpus)
    base = prepare(data, TOK, seed=0).manifest["key"]
    assert (
        prepare(data.model_copy(update={"val_fraction": 0.3}), TOK, seed=0).manifest["key"] != base
    )
    assert prepare(data, TOK, seed=1).manifest["key"] != base
    assert prepare(data, TOK.model_copy(update={"vocab_size": 290}), seed=0).manifest["key"] != base

    # Same size, one byte different: the content hash sees it.
    path = corpus[0] / "t0.txt"
    text = path.read_text()
    path.write_text(("X" + text[1:]) if text[0] != "X" else ("Y" + text[1:]))
    changed = prepare(data, TOK, seed=0)
    assert not changed.cached and changed.manifest["key"] != base

    # A source's mixture weight does not change what is prepared.
    reweighted = data.model_copy(
        update={"sources": [data.sources[0].model_copy(update={"weight": 3.0}), data.sources[1]]}
    )
    assert prepare(reweighted, TOK, seed=0).cached


def test_damaged_cache_entry_is_rebuilt(tmp_path, corpus):
    data = _data(tmp_path, *corpus)
    first = prepare(data, TOK, seed=0)
    (first.dir / first.manifest["splits"]["train"]["shards"][0]).unlink()
    messages = []
    again = prepare(data, TOK, seed=0, log=messages.append)
    assert not again.cached and any("damaged" in m for m in messages)
    assert again.manifest == first.manifest


def test_val_split_is_deterministic_whole_documents_and_at_least_one():
    texts = [f"document {i}" for i in range(40)]
    mask = split_documents(texts, 0.1, seed=0)
    assert mask.sum() == 4 and np.array_equal(mask, split_documents(texts, 0.1, seed=0))
    assert not np.array_equal(mask, split_documents(texts, 0.1, seed=1))
    # Chosen by content, not position: shuffling the input keeps the same val documents.
    chosen = {t for t, v in zip(texts, mask, strict=True) if v}
    shuffled = texts[::-1]
    again = {t for t, v in zip(shuffled, split_documents(shuffled, 0.1, seed=0), strict=True) if v}
    assert again == chosen
    assert split_documents(texts[:3], 0.01, seed=0).sum() == 1  # at least one
    assert split_documents(texts[:2], 0.9, seed=0).sum() == 1  # at least one train document
    assert split_documents(texts[:1], 0.5, seed=0).sum() == 0  # one document: all train
    assert split_documents(texts, 0.0, seed=0).sum() == 0


def test_no_val_split(tmp_path, corpus):
    prepared = prepare(_data(tmp_path, *corpus, val_fraction=0.0), TOK, seed=0)
    assert len(prepared.val) == 0 and prepared.manifest["splits"]["val"]["shards"] == []
    assert prepared.manifest["splits"]["train"]["documents"] == 10


def test_hf_tokenizer_is_loaded_not_trained(tmp_path, corpus, small_tokenizer):
    path = tmp_path / "my-tokenizer.json"
    small_tokenizer.save(path)
    prepared = prepare(_data(tmp_path, *corpus), TokenizerConfig(kind="hf", path=str(path)), seed=0)
    assert prepared.tokenizer.sha256 == small_tokenizer.sha256
    assert prepared.manifest["tokenizer"]["vocab_size"] == 400


def test_no_sources_is_an_error(tmp_path):
    with pytest.raises(TrainbookError, match="no data sources") as err:
        prepare(DataConfig(cache_dir=str(tmp_path)), TOK, seed=0)
    assert err.value.where == "data.sources"


def test_source_without_documents_is_named(tmp_path, corpus, write_files):
    empty = write_files({"a.txt": "", "b.txt": "\n\n  \n"}, under="empty")
    data = _data(tmp_path, *corpus)
    data = data.model_copy(
        update={"sources": [*data.sources, SourceConfig(name="blank", paths=[f"{empty}/*.txt"])]}
    )
    with pytest.raises(TrainbookError, match="source 'blank' has no documents") as err:
        prepare(data, TOK, seed=0)
    assert err.value.where == "data.sources[2]"


def test_missing_input_names_the_source_key(tmp_path, corpus):
    data = _data(tmp_path, *corpus)
    missing = SourceConfig(name="gone", paths=[str(tmp_path / "nowhere" / "*.txt")])
    with pytest.raises(TrainbookError, match="no file matches") as err:
        prepare(data.model_copy(update={"sources": [missing]}), TOK, seed=0)
    assert err.value.where == "data.sources[0].paths"


def test_literal_eos_string_in_a_document_stays_text(tmp_path, write_files):
    root = write_files({"a.txt": f"one {EOS} two", "b.txt": "three"})
    data = DataConfig(
        sources=[SourceConfig(name="s", paths=[f"{root}/*.txt"])],
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.0,
    )
    prepared = prepare(data, TOK, seed=0)
    ids = prepared.train.read(0, len(prepared.train))
    assert (ids == prepared.tokenizer.eos_id).sum() == 2  # one per document, none from the text
    assert _documents_of(prepared.train, prepared.tokenizer) == [f"one {EOS} two", "three"]
