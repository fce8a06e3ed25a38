from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from trainbook.config.data import DataConfig, DedupConfig, SourceConfig, TokenizerConfig
from trainbook.data import Prepared, prepare
from trainbook.data.documents import DocumentStream, unit_hash
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
    markdown = write_files({f"m{i}.md": "**KING**  \n" + pieces[7 + i] for i in range(3)}, under="md")
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
    manifest, tok = prepared.manifest, prepared.tokenizer
    assert (prepared.dir / "tokenizer" / "tokenizer_meta.json").is_file()
    assert manifest["tokenizer"]["sha256"] == tok.sha256 and manifest["key"].startswith(prepared.dir.name)
    assert any(m.startswith("text: 7 files, 7 documents read") for m in messages), messages

    originals = {"text": [p.read_text().strip() for p in sorted(corpus[0].glob("*.txt"))],
                 "plays": [markdown_to_text(p.read_text()).strip() for p in sorted(corpus[1].glob("*.md"))]}
    assert set(prepared.train) == {"text", "plays"}  # one train stream per source
    val_docs = _documents_of(prepared.val, tok)
    assert val_docs, "the split always holds out a document"
    for name, docs in originals.items():
        train_docs = _documents_of(prepared.train[name], tok)
        # Whole documents; in corpus order except the split's stand-in, which may come later.
        assert sorted(train_docs) == sorted(d for d in docs if d not in val_docs)
    assert sorted(val_docs + [d for s in prepared.train for d in _documents_of(prepared.train[s], tok)]) == sorted(
        originals["text"] + originals["plays"])

    # Token counts per source and split: each document's tokens plus its EOS.
    for source in manifest["sources"]:
        train = _documents_of(prepared.train[source["name"]], tok)
        assert source["tokens"]["train"] == sum(len(tok.encode(d)) + 1 for d in train)
        assert source["documents_out"]["train"] == len(train)
    assert manifest["splits"]["val"]["tokens"] == len(prepared.val)
    # More tokens than shard_tokens: several shards, each verified, each <= 1024 tokens.
    names = [n for s in manifest["sources"] for split in ("train", "val") for n in s["shards"][split]]
    assert len(manifest["sources"][0]["shards"]["train"]) > 1
    for name in names:
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
    np.testing.assert_array_equal(second.train["text"].read(0, 500), first.train["text"].read(0, 500))


def test_key_changes_with_file_content_and_relevant_settings(tmp_path, corpus):
    data = _data(tmp_path, *corpus)
    base = prepare(data, TOK, seed=0).manifest["key"]
    assert prepare(data.model_copy(update={"val_fraction": 0.3}), TOK, seed=0).manifest["key"] != base
    assert prepare(data, TOK, seed=1).manifest["key"] != base
    assert prepare(data, TOK.model_copy(update={"vocab_size": 290}), seed=0).manifest["key"] != base
    nodedup = data.model_copy(update={"dedup": DedupConfig(exact=False)})
    assert prepare(nodedup, TOK, seed=0).manifest["key"] != base
    path = corpus[0] / "t0.txt"  # same size, one byte different: the content hash sees it
    text = path.read_text()
    path.write_text(("X" + text[1:]) if text[0] != "X" else ("Y" + text[1:]))
    changed = prepare(data, TOK, seed=0)
    assert not changed.cached and changed.manifest["key"] != base
    # A source's mixture weight does not change what is prepared.
    reweighted = data.model_copy(
        update={"sources": [data.sources[0].model_copy(update={"weight": 3.0}), data.sources[1]]})
    assert prepare(reweighted, TOK, seed=0).cached


def test_damaged_cache_entry_is_rebuilt(tmp_path, corpus):
    data = _data(tmp_path, *corpus)
    first = prepare(data, TOK, seed=0)
    shard = first.dir / first.manifest["sources"][0]["shards"]["train"][0]
    shard.write_bytes(shard.read_bytes()[:-2])  # truncated
    messages = []
    again = prepare(data, TOK, seed=0, log=messages.append)
    assert not again.cached and any("damaged" in m for m in messages)
    assert again.manifest["splits"] == first.manifest["splits"]


def test_cleaning_and_dedup_counts_per_source(tmp_path, write_files, hamlet):
    a = write_files({"1.txt": hamlet[:3000], "2.txt": hamlet[:3000], "3.txt": "tiny", "4.txt": hamlet[3000:6000]},
                    under="a")
    b = write_files({"1.txt": hamlet[:3000], "2.txt": hamlet[6000:9000]}, under="b")
    data = DataConfig(
        sources=[SourceConfig(name="a", paths=[f"{a}/*.txt"]), SourceConfig(name="b", paths=[f"{b}/*.txt"])],
        cache_dir=str(tmp_path / "cache"), val_fraction=0.0, clean={"min_chars": 10})
    manifest = prepare(data, TOK, seed=0).manifest
    a_report, b_report = manifest["sources"]
    assert a_report["read"]["documents"] == 4 and a_report["cleaning"]["dropped_too_short"] == 1
    assert a_report["duplicates"]["exact"] == 1 and b_report["duplicates"]["exact"] == 1  # across sources
    assert a_report["documents_out"]["train"] == 2 and b_report["documents_out"]["train"] == 1


def test_num_proc_writes_the_same_shards(tmp_path, corpus):
    one = prepare(_data(tmp_path, *corpus, cache_dir=str(tmp_path / "c1")), TOK, seed=0)
    two = prepare(_data(tmp_path, *corpus, cache_dir=str(tmp_path / "c2"), num_proc=2), TOK, seed=0)
    for name in ("text", "plays"):
        np.testing.assert_array_equal(one.train[name].read(0, len(one.train[name])),
                                      two.train[name].read(0, len(two.train[name])))
    np.testing.assert_array_equal(one.val.read(0, len(one.val)), two.val.read(0, len(two.val)))


def test_split_is_by_content_and_holds_out_at_least_one(tmp_path, write_files):
    root = write_files({f"{i:02d}.txt": f"document number {i}" for i in range(40)})
    data = DataConfig(sources=[SourceConfig(name="s", paths=[f"{root}/*.txt"])], val_fraction=0.25,
                      dedup={"exact": False})
    docs = list(DocumentStream(data, seed=0))
    val = {d.text for d in docs if d.is_val}
    assert val == {d.text for d in docs if unit_hash(0, d.text) < 0.25}
    assert 0 < len(val) < 40 and len(docs) == 40
    assert val != {d.text for d in DocumentStream(data, seed=1) if d.is_val}
    # Two documents, a tiny fraction: the stand-in rule still holds one out (the smallest u).
    few = data.model_copy(update={"val_fraction": 1e-9,
                                  "sources": [SourceConfig(name="s", paths=[f"{root}/0[01].txt"])]})
    docs = list(DocumentStream(few, seed=0))
    assert [d.is_val for d in docs].count(True) == 1
    held = min(docs, key=lambda d: unit_hash(0, d.text))
    assert held.is_val


def test_interrupted_prepare_leaves_nothing_readable_and_a_rerun_finishes(tmp_path, hamlet, write_files):
    root = write_files({f"{i:03d}.txt": hamlet[(i % 60) * 2000 : (i % 60 + 1) * 2000] + f"\n{i}" for i in range(600)})
    data = DataConfig(sources=[SourceConfig(name="s", paths=[f"{root}/*.txt"])],
                      cache_dir=str(tmp_path / "cache"), shard_tokens=4096)
    code = ("import sys; from trainbook.config.data import DataConfig, TokenizerConfig; from trainbook.data import prepare;"
            "prepare(DataConfig.model_validate_json(sys.argv[1]), TokenizerConfig(vocab_size=300), seed=0)")
    proc = subprocess.Popen([sys.executable, "-c", code, data.model_dump_json()])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list((tmp_path / "cache").glob("*/train-*.json"))) < 3:
        time.sleep(0.01)  # kill it in the middle of writing shards
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    entry = next((tmp_path / "cache").iterdir())
    assert not (entry / "manifest.json").exists()  # never marked complete
    indexes = [p for p in entry.glob("*.json") if p.name != "manifest.json"]
    assert indexes, "killed before any shard was written"
    for index in indexes:
        verify_shard(index.with_suffix(".bin"))  # every shard that has an index is whole
    done = prepare(data, TOK, seed=0)
    assert not done.cached and (entry / "manifest.json").is_file()
    assert done.manifest["splits"]["train"]["documents"] + done.manifest["splits"]["val"]["documents"] == 600


def test_hf_tokenizer_is_loaded_not_trained(tmp_path, corpus, small_tokenizer):
    small_tokenizer.save(tmp_path / "tok")
    cfg = TokenizerConfig(kind="hf", path=str(tmp_path / "tok" / "tokenizer.json"))
    prepared = prepare(_data(tmp_path, *corpus), cfg, seed=0)
    assert prepared.manifest["tokenizer"]["vocab_size"] == small_tokenizer.vocab_size
    assert prepared.tokenizer.encode("To be, or not") == small_tokenizer.encode("To be, or not")


def test_no_sources_is_an_error(tmp_path):
    with pytest.raises(TrainbookError, match="no data sources") as err:
        prepare(DataConfig(cache_dir=str(tmp_path)), TOK, seed=0)
    assert err.value.where == "data.sources"


def test_source_without_documents_is_named(tmp_path, corpus, write_files):
    empty = write_files({"a.txt": "", "b.txt": "\n\n  \n"}, under="empty")
    data = _data(tmp_path, *corpus)
    data = data.model_copy(update={"sources": [*data.sources, SourceConfig(name="blank", paths=[f"{empty}/*.txt"])]})
    with pytest.raises(TrainbookError) as err:
        prepare(data, TOK, seed=0)
    assert err.value.where == "data.sources[2]"
    assert err.value.message == (f"source 'blank' has no documents left in 2 files ('{empty}/a.txt', "
                                 f"'{empty}/b.txt') (read 0, after cleaning and deduplication: 0)")
    assert not (tmp_path / "cache").exists()  # bad input leaves no cache entry behind

    one = write_files({"e.txt": ""}, under="one")
    data = data.model_copy(update={"sources": [SourceConfig(name="e", paths=[f"{one}/*.txt"])]})
    with pytest.raises(TrainbookError) as err:
        prepare(data, TOK, seed=0)
    assert err.value.message == f"source 'e' has no documents left in '{one}/e.txt' (read 0, after cleaning and deduplication: 0)"


def test_missing_input_names_the_source_key(tmp_path, corpus):
    missing = SourceConfig(name="gone", paths=[str(tmp_path / "nowhere" / "*.txt")])
    with pytest.raises(TrainbookError, match="no file matches") as err:
        prepare(_data(tmp_path, *corpus).model_copy(update={"sources": [missing]}), TOK, seed=0)
    assert err.value.where == "data.sources[0].paths"


def test_literal_eos_string_in_a_document_stays_text(tmp_path, write_files):
    root = write_files({"a.txt": f"one {EOS} two", "b.txt": "three"})
    data = DataConfig(sources=[SourceConfig(name="s", paths=[f"{root}/*.txt"])],
                      cache_dir=str(tmp_path / "cache"), val_fraction=0.0)
    prepared = prepare(data, TOK, seed=0)
    stream = prepared.train["s"]
    assert (stream.read(0, len(stream)) == prepared.tokenizer.eos_id).sum() == 2  # one per document
    assert _documents_of(stream, prepared.tokenizer) == [f"one {EOS} two", "three"]


def test_flipped_byte_in_a_cached_shard_is_detected_and_rebuilt(tmp_path, corpus):
    data = _data(tmp_path, *corpus)
    first = prepare(data, TOK, seed=0)
    name = first.manifest["sources"][1]["shards"]["train"][0]
    index = read_index(first.dir / name)
    assert index["source"] == "plays" and index["tokenizer_sha256"] == first.tokenizer.sha256
    raw = bytearray((first.dir / name).read_bytes())
    raw[5] ^= 0xFF  # same size, one byte different
    (first.dir / name).write_bytes(bytes(raw))
    messages = []
    again = prepare(data, TOK, seed=0, log=messages.append)
    assert not again.cached and any("checksum mismatch" in m for m in messages), messages
    verify_shard(again.dir / name)
