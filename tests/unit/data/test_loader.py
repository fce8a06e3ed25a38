from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from trainbook.config.schema import DataConfig, SourceConfig, TokenizerConfig
from trainbook.data import TrainLoader, prepare, val_batches
from trainbook.data.shards import ShardWriter, TokenStream
from trainbook.errors import TrainbookError

T, B = 16, 4


def _stream(tmp_path, n_tokens: int, max_tokens: int = 1 << 20) -> TokenStream:
    """A stream whose token at position p is p % 65000: every sample shows where it came from."""
    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16), max_tokens)
    writer.add(np.arange(n_tokens) % 65000)
    return TokenStream([tmp_path / name for name in writer.close()])


def _sample_ids(inputs: torch.Tensor) -> list[int]:
    return (inputs[:, 0] // T).tolist()


def test_samples_are_consecutive_windows_and_targets_are_shifted(tmp_path):
    stream = _stream(tmp_path, 1000)
    loader = TrainLoader(stream, seq_len=T, micro_batch_size=B, seed=0)
    assert loader.samples_per_epoch == (1000 - 1) // T == 62
    inputs, targets = next(loader)
    assert inputs.shape == targets.shape == (B, T)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.is_contiguous() and targets.is_contiguous()
    for row_in, row_out in zip(inputs, targets, strict=True):
        i = int(row_in[0]) // T
        # sample i = stream[i*T : i*T + T + 1]; inputs its first T tokens, targets its last T.
        assert row_in.tolist() == list(range(i * T, i * T + T))
        assert row_out.tolist() == list(range(i * T + 1, i * T + T + 1))


def test_each_epoch_is_a_fresh_permutation_without_repeats(tmp_path):
    loader = TrainLoader(_stream(tmp_path, 1000), seq_len=T, micro_batch_size=B, seed=0)
    assert loader.batches_per_epoch == 62 // B == 15
    epochs = []
    for _ in range(3):
        seen = [i for _ in range(loader.batches_per_epoch) for i in _sample_ids(next(loader)[0])]
        assert len(seen) == len(set(seen)) == 60  # 2 samples of the 62 left over each epoch
        epochs.append(seen)
    assert loader.state_dict() == {"epoch": 2, "index": 60}
    next(loader)
    assert loader.state_dict() == {"epoch": 3, "index": B}  # rolled over on the next draw
    assert epochs[0] != epochs[1] != epochs[2]


def test_same_seed_same_batches_other_seed_other_batches(tmp_path):
    stream = _stream(tmp_path, 1000)

    def first(seed, n=20):
        loader = TrainLoader(stream, seq_len=T, micro_batch_size=B, seed=seed)
        return [next(loader)[0] for _ in range(n)]

    a, b, c = first(0), first(0), first(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("stop", [0, 1, 14, 15, 31])  # fresh, mid-epoch, epoch edges
def test_resume_from_state_dict_continues_exactly(tmp_path, stop):
    stream = _stream(tmp_path, 1000)
    reference = TrainLoader(stream, seq_len=T, micro_batch_size=B, seed=7)
    expected = [next(reference) for _ in range(stop + 20)][stop:]

    interrupted = TrainLoader(stream, seq_len=T, micro_batch_size=B, seed=7)
    for _ in range(stop):
        next(interrupted)
    state = interrupted.state_dict()
    assert all(type(v) is int for v in state.values())

    resumed = TrainLoader(stream, seq_len=T, micro_batch_size=B, seed=7)
    resumed.load_state_dict(dict(state))
    for (x, y), (ex, ey) in zip(itertools.islice(resumed, 20), expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_multi_shard_stream_gives_the_same_batches(tmp_path):
    (tmp_path / "one").mkdir(), (tmp_path / "many").mkdir()
    one = TrainLoader(_stream(tmp_path / "one", 5000), seq_len=T, micro_batch_size=B, seed=0)
    many = TrainLoader(
        _stream(tmp_path / "many", 5000, max_tokens=1024), seq_len=T, micro_batch_size=B, seed=0
    )
    assert len(many.stream.paths) == 5
    for _ in range(200):  # more than one epoch: many batches straddle shard boundaries
        x, y = next(one)
        mx, my = next(many)
        assert torch.equal(x, mx) and torch.equal(y, my)


def test_data_parallel_ranks_take_disjoint_slices(tmp_path):
    stream = _stream(tmp_path, 1000)
    single = TrainLoader(stream, seq_len=T, micro_batch_size=2 * B, seed=3)
    ranks = [TrainLoader(stream, T, B, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(10):
        both = torch.cat([next(r)[0] for r in ranks])
        assert torch.equal(both, next(single)[0])
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_train_split_shorter_than_one_batch_is_an_error(tmp_path):
    stream = _stream(tmp_path, B * T)  # B*T tokens: B - 1 samples of T + 1
    with pytest.raises(TrainbookError, match="fewer than one batch") as err:
        TrainLoader(stream, seq_len=T, micro_batch_size=B, seed=0)
    assert err.value.where == "train.seq_len"
    TrainLoader(_stream(tmp_path, B * T + 1), seq_len=T, micro_batch_size=B, seed=0)  # just enough


def test_val_batches_are_fixed_and_wrap_around(tmp_path):
    stream = _stream(tmp_path, 6 * T + 1)  # 6 samples
    batches = list(val_batches(stream, seq_len=T, micro_batch_size=B, n_batches=3))
    assert [_sample_ids(x) for x, _ in batches] == [[0, 1, 2, 3], [4, 5, 0, 1], [2, 3, 4, 5]]
    again = list(val_batches(stream, seq_len=T, micro_batch_size=B, n_batches=3))
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    x, y = batches[0]
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_val_split_without_a_sample_is_an_error(tmp_path):
    with pytest.raises(TrainbookError, match="less than one sample") as err:
        val_batches(_stream(tmp_path, T), seq_len=T, micro_batch_size=B, n_batches=2)
    assert err.value.where == "data.val_fraction"
    with pytest.raises(TrainbookError):
        val_batches(TokenStream([]), seq_len=T, micro_batch_size=B, n_batches=2)


def test_packed_batches_from_prepared_documents(tmp_path, write_files):
    """EOS between documents; a batch decodes back to the documents' text."""
    texts = {f"d{i}.txt": f"Document number {i} speaks a line of verse." for i in range(30)}
    root = write_files(texts)
    data = DataConfig(
        sources=[SourceConfig(name="s", paths=[f"{root}/*.txt"])],
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.0,
    )
    prepared = prepare(data, TokenizerConfig(vocab_size=300), seed=0)
    tok = prepared.tokenizer
    stream = prepared.train.read(0, len(prepared.train))
    documents = tok.decode(stream.tolist()).split(tok.eos_token)
    assert documents == [texts[f"d{i}.txt"] for i in sorted(range(30), key=str)] + [""]

    loader = TrainLoader(prepared.train, seq_len=T, micro_batch_size=B, seed=0)
    x, y = next(loader)
    assert torch.equal(y[:, :-1], x[:, 1:])
    # Every sample starts on a multiple of seq_len: rows are windows stream[i*T : i*T + T].
    windows = stream[: loader.samples_per_epoch * T].reshape(-1, T).astype(np.int64)
    for row in x.numpy():
        assert (windows == row).all(axis=1).any()
