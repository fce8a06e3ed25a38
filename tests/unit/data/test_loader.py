from __future__ import annotations

import numpy as np
import pytest
import torch

from trainbook.data import TrainLoader, val_batches
from trainbook.data.loader import DeliveredMix
from trainbook.data.samples import Batch, document_positions
from trainbook.data.shards import ShardWriter, TokenStream
from trainbook.errors import TrainbookError

T, B = 16, 4
SIZES = {"web": 1601, "code": 801, "books": 161}  # tokens: 100, 50 and 10 samples of T + 1
WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def _stream(directory, source: int, n_tokens: int, max_tokens: int = 1 << 20) -> TokenStream:
    """Token at position p of source k is k * 10**6 + p: every sample shows where it came from."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(directory, "train", np.dtype(np.uint32), max_tokens)
    writer.add(source * 10**6 + np.arange(n_tokens))
    return TokenStream([directory / name for name in writer.close()])


@pytest.fixture
def streams(tmp_path) -> dict[str, TokenStream]:
    return {name: _stream(tmp_path / name, k, n) for k, (name, n) in enumerate(SIZES.items())}


def _loader(streams, **kw) -> TrainLoader:
    return TrainLoader(streams, WEIGHTS, kw.pop("seq_len", T), kw.pop("micro_batch_size", B),
                       kw.pop("seed", 0), **kw)


def _decode(batch: Batch) -> list[tuple[int, int]]:
    """(source index, sample id) of each row."""
    first = batch.inputs[:, 0]
    return list(zip((first // 10**6).tolist(), ((first % 10**6) // T).tolist()))


def _expected(loader: TrainLoader, g: np.ndarray) -> list[tuple[int, int]]:
    source, ids = loader.order.sample_ids(g)
    return list(zip(source.tolist(), ids.tolist()))


def test_samples_are_consecutive_windows_and_targets_are_shifted(streams):
    batch = next(_loader(streams))
    assert isinstance(batch, Batch) and batch.positions is None
    inputs, targets = batch[:2]
    assert inputs.shape == targets.shape == (B, T)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.is_contiguous() and targets.is_contiguous()
    for row_in, row_out in zip(inputs.tolist(), targets.tolist(), strict=True):
        start = row_in[0]
        assert (start % 10**6) % T == 0  # sample i = stream[i*T : i*T + T + 1]
        assert row_in == list(range(start, start + T))
        assert row_out == list(range(start + 1, start + T + 1))


def test_same_seed_same_batches_other_seed_other_batches(streams):
    def first(seed, n=20):
        loader = _loader(streams, seed=seed)
        return [next(loader).inputs for _ in range(n)]

    a, b, c = first(0), first(0), first(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_iteration_follows_the_global_order_a_pure_function(streams):
    loader = _loader(streams)
    read = [row for _ in range(100) for row in _decode(next(loader))]  # 400 samples: re-epochs
    assert read == _expected(loader, np.arange(400))
    assert loader.state_dict() == {"consumed": 400}
    # Jumping straight to a position reads what iteration would have reached there.
    far = _loader(streams)
    far.load_state_dict({"consumed": 10**12})
    assert _decode(next(far)) == _expected(far, np.arange(10**12, 10**12 + B))


def test_delivered_rows_are_counted_per_source_and_match_the_weights(streams):
    """Every batch names each row's source; DeliveredMix counts what passes through it, and any
    run of n rows holds each source within 2 rows of its weight's share (the mix_drift rule's
    premise, monitor/alerts.py)."""
    loader = _loader(streams)
    delivered = DeliveredMix(iter(loader), len(SIZES))
    counts = np.zeros(3, dtype=np.int64)
    for step in range(1, 251):
        batch = next(delivered)
        assert [s for s, _ in _decode(batch)] == batch.sources.tolist()
        counts += np.bincount(batch.sources.numpy(), minlength=3)
        if step % 10 == 0:  # 40 rows at a time, anywhere in the order
            rows = delivered.take()
            expect = np.array(list(WEIGHTS.values())) * 40
            assert np.all(np.abs(rows - expect) <= 2), (step, rows)
    assert delivered.take().tolist() == [0, 0, 0]  # take() starts the count again
    share = loader.mixture_share(counts)
    assert list(share) == list(SIZES)
    for k, name in enumerate(SIZES):
        assert share[name]["target"] == pytest.approx(WEIGHTS[name])
        assert share[name]["rows"] == counts[k]
        assert share[name]["actual"] == counts[k] / 1000
        assert abs(share[name]["actual"] - WEIGHTS[name]) < 0.005
    assert loader.mixture_share(np.zeros(3, dtype=np.int64))["web"]["actual"] == 0.0  # nothing taken yet


def test_reepoch_callback_reports_each_new_source_epoch_once(streams):
    calls = []
    loader = _loader(streams, on_reepoch=lambda source, epoch: calls.append((source, epoch)))
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(50):  # 200 samples: books (10 samples, 20%) runs through 4 epochs
        for source, sample in _decode(next(loader)):
            seen[source].append(sample)
    assert [c for c in calls if c[0] == "books"] == [("books", e) for e in (1, 2, 3)]
    assert [c for c in calls if c[0] == "code"] == [("code", 1)]  # 60 samples of 50
    assert not [c for c in calls if c[0] == "web"]  # 100 samples of 100: still epoch 0
    books = seen[2]
    for e in range(4):  # every epoch of "books" is a permutation of its 10 samples
        assert sorted(books[10 * e : 10 * e + 10]) == list(range(10))
    # A resumed loader reports the epochs that start after the resume point, no earlier ones.
    resumed_calls = []
    resumed = _loader(streams, on_reepoch=lambda source, epoch: resumed_calls.append((source, epoch)))
    resumed.load_state_dict(loader.state_dict())
    next(resumed), next(loader)  # samples 200..203: web's epoch 1 and books' epoch 4 begin
    assert resumed_calls == calls[-2:] == [("web", 1), ("books", 4)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_data_parallel_ranks_are_disjoint_and_complete(streams, world_size):
    ranks = [_loader(streams, rank=r, world_size=world_size) for r in range(world_size)]
    read = []
    for _ in range(8):  # micro-batch k of rank r holds global samples [(k * W + r) * B, + B)
        for loader in ranks:
            read += _decode(next(loader))
    assert read == _expected(ranks[0], np.arange(8 * world_size * B))
    assert all(loader.state_dict() == {"consumed": 8 * world_size * B} for loader in ranks)


@pytest.mark.parametrize(("before", "after"), [(2, 4), (4, 1), (1, 2)])
def test_resume_at_another_world_size_reads_the_next_unseen_samples(streams, before, after):
    old = [_loader(streams, rank=r, world_size=before) for r in range(before)]
    read = []
    for _ in range(3):
        for loader in old:
            read += _decode(next(loader))
    state = old[0].state_dict()
    assert all(type(v) is int for v in state.values())
    new = [_loader(streams, rank=r, world_size=after, micro_batch_size=3) for r in range(after)]
    for loader in new:
        loader.load_state_dict(dict(state))
    for _ in range(3):
        for loader in new:
            read += _decode(next(loader))
    n = 3 * before * B + 3 * after * 3
    assert read == _expected(old[0], np.arange(n))  # nothing skipped, nothing read twice
    assert new[0].state_dict() == {"consumed": n}


def test_workers_give_the_same_batches_and_an_exact_state(streams):
    reference = _loader(streams, packing="document", eos_id=5)
    expected = [next(reference) for _ in range(12)]
    loader = _loader(streams, packing="document", eos_id=5, num_workers=2, pin_memory=False)
    try:
        for k in range(5):
            batch = next(loader)
            assert all(x is y is None or torch.equal(x, y) for x, y in zip(batch, expected[k], strict=True))
        # Workers have prefetched ahead; the state counts only what was taken.
        assert loader.state_dict() == {"consumed": 5 * B}
        loader.load_state_dict({"consumed": 8 * B})  # a jump: prefetched batches are dropped
        for k in range(8, 12):
            assert all(x is y is None or torch.equal(x, y) for x, y in zip(next(loader), expected[k], strict=True))
        assert loader.state_dict() == {"consumed": 12 * B}
    finally:
        loader.close()


def test_multi_shard_streams_give_the_same_batches(tmp_path, streams):
    many = {name: _stream(tmp_path / "many" / name, k, n, max_tokens=64)
            for k, (name, n) in enumerate(SIZES.items())}
    assert len(many["web"].paths) == 26
    one, split = _loader(streams), _loader(many)
    for _ in range(60):  # many samples straddle shard boundaries
        assert all(torch.equal(x, y) for x, y in zip(next(one)[:2], next(split)[:2], strict=True))


def test_document_positions_restart_after_each_eos():
    eos = 0
    inputs = np.array([[7, 8, eos, 9, 9, 9, eos, eos, 4],
                       [eos, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_positions(inputs, eos).tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 0, 0],  # EOS ends its document; the next token starts at 0
        [0, 0, 1, 2, 3, 4, 5, 6, 7],
    ]


def test_document_packing_with_a_real_tokenizer(tmp_path, small_tokenizer):
    tok = small_tokenizer
    texts = [f"To be, or not to be: scene {i}." * (1 + i % 3) for i in range(40)]
    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16), 1 << 20)
    for text in texts:
        writer.add(np.array(tok.encode(text) + [tok.eos_id]))
    stream = TokenStream([tmp_path / n for n in writer.close()])
    loader = TrainLoader({"plays": stream}, {"plays": 1.0}, T, B, seed=0, packing="document",
                         eos_id=tok.eos_id)
    for _ in range(5):
        batch = next(loader)
        assert batch.positions.shape == (B, T) and batch.positions.dtype == torch.int64
        for row, pos in zip(batch.inputs.tolist(), batch.positions.tolist(), strict=True):
            pieces = tok.decode(row).split(tok.eos_token)  # the window's documents (or parts)
            assert pos.count(0) == len(pieces) - (pieces[-1] == "")
            for t in range(1, T):
                assert pos[t] == (0 if row[t - 1] == tok.eos_id else pos[t - 1] + 1)


def test_errors_name_the_key(streams, tmp_path):
    with pytest.raises(TrainbookError, match="different sources") as err:
        TrainLoader(streams, {"web": 1.0}, T, B, seed=0)
    assert err.value.where == "data.sources"
    short = {"a": _stream(tmp_path / "a", 0, B * T)}  # B*T tokens: B - 1 samples of T + 1
    with pytest.raises(TrainbookError, match="fewer than one batch") as err:
        TrainLoader(short, {"a": 1.0}, T, B, seed=0)
    assert err.value.where == "train.seq_len"
    empty = {**streams, "tiny": _stream(tmp_path / "tiny", 3, T)}
    with pytest.raises(TrainbookError, match="source 'tiny'") as err:
        TrainLoader(empty, {**WEIGHTS, "tiny": 1.0}, T, B, seed=0)
    assert err.value.where == "train.seq_len"
    with pytest.raises(TrainbookError, match="EOS id") as err:
        _loader(streams, packing="document")
    assert err.value.where == "data.packing"


def test_val_batches_are_fixed_and_wrap_around(tmp_path):
    stream = _stream(tmp_path, 0, 6 * T + 1)  # 6 samples
    batches = list(val_batches(stream, seq_len=T, micro_batch_size=B, n_batches=3))
    assert [[s for _, s in _decode(b)] for b in batches] == [[0, 1, 2, 3], [4, 5, 0, 1], [2, 3, 4, 5]]
    again = list(val_batches(stream, seq_len=T, micro_batch_size=B, n_batches=3))
    for b, b2 in zip(batches, again, strict=True):
        assert torch.equal(b.inputs, b2.inputs) and torch.equal(b.targets, b2.targets)
    assert batches[0].positions is None
    assert torch.equal(batches[0].targets[:, :-1], batches[0].inputs[:, 1:])
    doc = next(val_batches(stream, T, B, 1, "document", eos_id=int(stream.read(5, 6)[0])))
    assert doc.positions[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_val_split_without_a_sample_is_an_error(tmp_path):
    with pytest.raises(TrainbookError, match="less than one sample") as err:
        val_batches(_stream(tmp_path, 0, T), seq_len=T, micro_batch_size=B, n_batches=2)
    assert err.value.where == "data.val_fraction"
    with pytest.raises(TrainbookError):
        val_batches(TokenStream([]), seq_len=T, micro_batch_size=B, n_batches=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_skipped_window_is_never_delivered(streams, num_workers):
    """Global samples [3B, 6B) skipped: batch 3 is followed by what batch 6 would have been."""
    reference = _loader(streams)
    expected = [next(reference) for _ in range(9)]
    loader = _loader(streams, num_workers=num_workers)
    try:
        loader.skip(3 * B, 6 * B)
        got = [next(loader) for _ in range(6)]
        assert loader.last_base == 8 * B and loader.state_dict() == {"consumed": 9 * B}
    finally:
        loader.close()
    for batch, want in zip(got, expected[:3] + expected[6:], strict=True):
        assert torch.equal(batch.inputs, want.inputs) and torch.equal(batch.sources, want.sources)


def test_provenance_names_each_rows_source_sample_and_document(tmp_path):
    from trainbook.data.provenance import batch_rows, document_span

    eos = 9
    tokens = np.array([1, 2, eos, 3, 4, 5, 6, 7, eos, 8, 8, 8, 8, 8, 8, 8, 8], dtype=np.uint32)  # 3 documents
    directory = tmp_path / "docs"
    directory.mkdir()
    writer = ShardWriter(directory, "train", np.dtype(np.uint32), 1 << 20)
    writer.add(tokens)
    stream = TokenStream([directory / name for name in writer.close()])
    assert document_span(stream, 4, 6, eos) == (3, 9, False)  # inside the second document, to its EOS
    assert document_span(stream, 1, 5, eos) == (0, 9, False)  # across the first EOS: both documents
    assert document_span(stream, 10, 12, eos, limit=2) == (8 + 1, 14, True)  # no EOS within the limit after
    loader = TrainLoader({"docs": stream}, {"docs": 1.0}, seq_len=2, micro_batch_size=2, seed=0, rank=1, world_size=2)
    rows = batch_rows(loader, base=4)  # rank 1's rows of the read at global sample 4: samples 6 and 7
    source, ids = loader.order.sample_ids(np.array([6, 7]))
    assert rows == [("docs", int(i), int(i) * 2) for i in ids] and set(source.tolist()) == {0}
