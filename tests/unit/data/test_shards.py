from __future__ import annotations

import json

import numpy as np
import pytest

from trainbook.data.shards import (
    ShardWriter,
    TokenStream,
    read_index,
    read_shard,
    token_dtype,
    verify_shard,
    write_shard,
)
from trainbook.errors import TrainbookError


def test_dtype_is_the_smallest_that_holds_the_vocab():
    assert token_dtype(2048) == np.uint16 and token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32 and token_dtype(128_256) == np.uint32


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_write_read_round_trip(tmp_path, dtype):
    tokens = np.arange(5000, dtype=np.int64) * 17 % np.iinfo(dtype).max
    tokens = tokens.astype(dtype)
    index = write_shard(tmp_path / "train-00000.bin", tokens, np.array([0, 10, 4000]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-00000.bin", "train-00000.json"]
    assert index == read_index(tmp_path / "train-00000.bin")
    assert (
        index["tokens"] == 5000 and index["documents"] == 3 and index["doc_starts"] == [0, 10, 4000]
    )
    assert index["dtype"] == np.dtype(dtype).name

    back = read_shard(tmp_path / "train-00000.bin")
    assert isinstance(back, np.memmap) and not back.flags.writeable
    np.testing.assert_array_equal(back, tokens)
    verify_shard(tmp_path / "train-00000.bin")


def test_checksum_detects_a_flipped_byte(tmp_path):
    path = tmp_path / "val-00000.bin"
    write_shard(path, np.arange(1000, dtype=np.uint16), np.array([0]))
    data = bytearray(path.read_bytes())
    data[777] ^= 0x01
    path.write_bytes(bytes(data))
    read_shard(path)  # same size: only the checksum can tell
    with pytest.raises(TrainbookError, match="checksum mismatch") as err:
        verify_shard(path)
    assert err.value.where == str(path)


def test_truncated_shard_is_refused(tmp_path):
    path = tmp_path / "train-00000.bin"
    write_shard(path, np.arange(1000, dtype=np.uint16), np.array([0]))
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(TrainbookError, match="1998 bytes, its index says 2000"):
        read_shard(path)


def test_writer_cuts_shards_at_max_tokens_and_tracks_document_starts(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 1000, size=n).astype(np.uint16) for n in (300, 2500, 10, 700, 90)]
    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16), max_tokens=1024)
    for doc in documents:
        writer.add(doc)
    names = writer.close()

    total = sum(len(d) for d in documents)  # 3600
    assert names == [f"train-{k:05d}.bin" for k in range(4)]
    assert (writer.documents, writer.tokens) == (5, total)
    sizes = [read_index(tmp_path / n)["tokens"] for n in names]
    assert sizes == [1024, 1024, 1024, total - 3 * 1024]

    # Every document starts where its shard's index says, counted once overall.
    stream = TokenStream([tmp_path / n for n in names])
    np.testing.assert_array_equal(stream.read(0, len(stream)), np.concatenate(documents))
    starts = [
        k * 1024 + s for k, n in enumerate(names) for s in read_index(tmp_path / n)["doc_starts"]
    ]
    assert starts == list(np.cumsum([0] + [len(d) for d in documents[:-1]]))


def test_stream_take_reads_rows_across_shard_boundaries(tmp_path):
    tokens = np.arange(3000, dtype=np.uint16)
    one = tmp_path / "one"
    many = tmp_path / "many"
    one.mkdir(), many.mkdir()
    write_shard(one / "train-00000.bin", tokens, np.array([0]))
    for k, lo in enumerate(range(0, 3000, 1024)):
        write_shard(many / f"train-{k:05d}.bin", tokens[lo : lo + 1024], np.array([], dtype=int))
    starts = np.array([0, 1000, 1020, 2040, 2900])
    expected = starts[:, None] + np.arange(99)
    for directory in (one, many):
        stream = TokenStream(sorted(directory.glob("*.bin")))
        assert len(stream) == 3000
        np.testing.assert_array_equal(stream.take(starts, 99), expected)
    with pytest.raises(IndexError):
        stream.take(np.array([2950]), 99)


def test_empty_stream(tmp_path):
    stream = TokenStream([])
    assert len(stream) == 0


def test_index_is_plain_json(tmp_path):
    write_shard(tmp_path / "x.bin", np.zeros(4, dtype=np.uint16), np.array([0, 2]))
    index = json.loads((tmp_path / "x.json").read_text())
    assert set(index) == {"format", "dtype", "tokens", "documents", "doc_starts", "sha256"}
