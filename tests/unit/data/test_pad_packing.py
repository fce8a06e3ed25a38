"""`data.packing = "pad"` (data/samples.py): one document per sample, right-padded to seq_len + 1.
The padded loss of a batch equals the token-weighted loss of its documents run one at a time
unpadded (1e-6); no target at or past a document's end is trained, whatever `loss_on`; a
document longer than the window is cut to it; the padding waste and the cut are counted as by
hand; and on real shards prepared from conversations with Qwen3's tokenizer each row is its
document, labels as the document alone gives them."""

from __future__ import annotations

import json

import numpy as np
import torch

from tests.conftest import REPO, qwen_tokenizer_files
from trainbook.config.data import DataConfig, SourceConfig, TokenizerConfig
from trainbook.config.model import ModelConfig
from trainbook.data import padding_report, prepare
from trainbook.data.chat import DOC_START, TRAINED
from trainbook.data.loader import TrainLoader, val_batches
from trainbook.data.samples import loss_select, to_batch
from trainbook.data.shards import ShardWriter, TokenStream
from trainbook.data.tokenizer import hf_tokenizer_config
from trainbook.model import build_model, resolve
from trainbook.train.objective import masked_loss_sum, trained_tokens

EOS = 511
T = 24
LENGTHS = [5, 17, 9, 30]  # tokens of each document, its EOS included; the last one is cut at T + 1


def _documents(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask bytes) of each document: a prompt (untrained), then an answer and its EOS trained."""
    rng = np.random.default_rng(seed)
    out = []
    for length in LENGTHS:
        ids = rng.integers(0, EOS, length)
        ids[-1] = EOS
        bits = np.zeros(length, dtype=np.uint8)
        bits[length // 3:] = TRAINED
        bits[0] |= DOC_START
        out.append((ids, bits))
    return out


def _shards(tmp_path, documents) -> tuple[TokenStream, TokenStream]:
    """Real shard files of 16 tokens each, so documents run on across shards."""
    tokens = ShardWriter(tmp_path, "train-00", np.dtype("<u2"), max_tokens=16)
    masks = ShardWriter(tmp_path, "train-00-mask", np.dtype("<u1"), max_tokens=16)
    for ids, bits in documents:
        tokens.add(ids)
        masks.add(bits)
    return (TokenStream([tmp_path / n for n in tokens.close()]),
            TokenStream([tmp_path / n for n in masks.close()]))


def _loader(stream, masks, loss_on: str = "auto", micro_batch_size: int = 4) -> TrainLoader:
    return TrainLoader({"chat": stream}, {"chat": 1.0}, T, micro_batch_size, seed=0, packing="pad", eos_id=EOS,
                       masks={"chat": masks}, loss_on=loss_on)


def _by_document(batch, stream, seq_len: int = T) -> list[int]:
    """Which document each row holds (rows come in the mixture's shuffled order)."""
    starts, lengths = stream.documents()
    return [next(d for d in range(len(starts)) if np.array_equal(
        row[:min(lengths[d], seq_len)], stream.read(starts[d], starts[d] + lengths[d])[:seq_len]))
        for row in batch.inputs.numpy()]


def test_a_padded_batch_trains_as_its_documents_alone(tmp_path):
    documents = _documents()
    stream, masks = _shards(tmp_path, documents)
    assert len(stream.paths) > 3 and stream.documents()[1].tolist() == LENGTHS
    batch = next(_loader(stream, masks))
    assert batch.positions is None and batch.inputs.shape == (4, T)  # plain causal: every row starts at 0
    order = _by_document(batch, stream)
    assert sorted(order) == [0, 1, 2, 3]
    for row, d in enumerate(order):
        ids, bits = documents[d]
        real = min(len(ids) - 1, T)  # targets that are the document's own
        assert batch.targets[row, :real].tolist() == ids[1:real + 1].tolist()
        assert (batch.inputs[row, len(ids):] == EOS).all() and (batch.targets[row, real:] == EOS).all()
        assert not batch.loss_mask[row, real:].any()  # no label from padding
        assert batch.loss_mask[row, :real].tolist() == ((bits[1:real + 1] & TRAINED) != 0).tolist()

    # Each document alone, unpadded (the cut one: its first T + 1 tokens, as the batch holds it).
    alone = [to_batch(ids[None, :T + 1], None, bits[None, :T + 1]) for ids, bits in documents]
    assert trained_tokens(batch) == sum(trained_tokens(b) for b in alone) > 0
    model = build_model(resolve(ModelConfig(name="debug")), torch.device("cpu"), seed=0)
    with torch.no_grad():
        padded = masked_loss_sum(model, batch) / trained_tokens(batch)
        unpadded = sum(masked_loss_sum(model, b) for b in alone) / sum(trained_tokens(b) for b in alone)
    assert abs(padded.item() - unpadded.item()) < 1e-6


def test_padding_is_never_trained_whatever_loss_on(tmp_path):
    stream, masks = _shards(tmp_path, _documents())
    batch = next(_loader(stream, masks, loss_on="all"))
    for row, d in enumerate(_by_document(batch, stream)):
        real = min(LENGTHS[d] - 1, T)
        assert batch.loss_mask[row].tolist() == [True] * real + [False] * (T - real)
    # Validation takes the documents in order, padded the same way.
    first = next(val_batches(stream, T, 2, 1, "pad", eos_id=EOS, masks=masks, loss_on="all"))
    assert first.loss_mask.sum(dim=1).tolist() == [LENGTHS[0] - 1, LENGTHS[1] - 1]


def test_a_micro_batch_cut_after_its_last_trained_target_computes_the_same_loss_and_gradients(tmp_path):
    """`pad_multiple`: the loader cuts pad packing's micro-batches after their last trained
    target, rounded up to the multiple; what is cut is padding and untrained tokens nothing before
    them attends to, so the loss and gradients are the uncut batch's."""
    documents = _documents()
    stream, masks = _shards(tmp_path, documents)

    def loader(multiple: int, micro_batch_size: int) -> TrainLoader:
        return TrainLoader({"chat": stream}, {"chat": 1.0}, T, micro_batch_size, seed=0, packing="pad", eos_id=EOS,
                           masks={"chat": masks}, pad_multiple=multiple)

    model = build_model(resolve(ModelConfig(name="debug")), torch.device("cpu"), seed=0)
    for multiple, micro_batch_size in ((1, 1), (8, 1), (8, 2)):
        uncut, cut = loader(0, micro_batch_size), loader(multiple, micro_batch_size)
        widths = []
        for _ in range(4 // micro_batch_size):
            whole, short = next(uncut), next(cut)
            last = int(torch.nonzero(whole.loss_mask.any(dim=0))[-1]) + 1
            width = short.inputs.shape[1]
            widths.append(width)
            assert width == min(T, -(-last // multiple) * multiple)
            for name in ("inputs", "targets", "loss_mask"):
                assert torch.equal(getattr(short, name), getattr(whole, name)[:, :width]), name
            assert trained_tokens(short) == trained_tokens(whole)
            losses, grads = [], []
            for batch in (whole, short):
                model.zero_grad()
                loss = masked_loss_sum(model, batch) / trained_tokens(batch)
                loss.backward()
                losses.append(loss.item())
                grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            assert abs(losses[0] - losses[1]) < 1e-6
            torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)
        if micro_batch_size == 1:  # one document a row, its last trained target at 4, 16, 8, 24
            assert sorted(widths) == ([4, 8, 16, 24] if multiple == 1 else [8, 8, 16, 24]), widths
    # Validation batches are cut the same way.
    first = next(val_batches(stream, T, 2, 1, "pad", eos_id=EOS, masks=masks, pad_multiple=8))
    assert first.inputs.shape == (2, 16)


def test_the_padding_waste_is_counted_as_by_hand(tmp_path):
    stream, _ = _shards(tmp_path, _documents())
    report = padding_report([stream], T)
    # Real targets per document: min(length - 1, T) = 4, 16, 8, 24 of T = 24 positions each;
    # the fourth document (30 tokens) is cut at T + 1 = 25 tokens and loses 29 - 24 = 5 targets.
    assert (report.documents, report.targets, report.truncated, report.cut) == (4, 52, 1, 5)
    assert abs(report.waste - 44 / 96) < 1e-12
    assert report.line() == (
        "pad packing: 4 documents padded to seq_len 24: 45.8% of positions are padding; 1 longer than "
        "seq_len + 1 = 25 tokens are cut there, 5 targets never trained (raise train.seq_len to keep them)")


def test_prepared_conversations_pad_one_per_row(tmp_path):
    """Real shards: conversations prepared with Qwen3's tokenizer and ChatML; each row is one
    conversation, its labels those of the conversation alone, its padding untrained."""
    path = tmp_path / "chat.jsonl"
    records = [{"messages": [{"role": "user", "content": f"What is {i}+{2 * i}?" + " Please." * (i % 4)},
                             {"role": "assistant", "content": f"{3 * i}."}]} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = TokenizerConfig(**{**hf_tokenizer_config(qwen_tokenizer_files()),
                             "chat_template": str(REPO / "tests" / "data" / "chatml.jinja")})
    data = DataConfig(sources=[SourceConfig(name="chat", paths=[str(path)], format="chat")],
                      cache_dir=str(tmp_path / "cache"), val_fraction=0.0)
    prepared = prepare(data, tok, seed=0)
    stream, masks, eos = prepared.train["chat"], prepared.train_masks["chat"], prepared.tokenizer.eos_id
    starts, lengths = stream.documents()
    assert len(starts) == 12 and lengths.max() <= 40
    loader = TrainLoader(prepared.train, {"chat": 1.0}, 40, 12, seed=0, packing="pad", eos_id=eos,
                         masks=prepared.train_masks)
    batch = next(loader)
    order = _by_document(batch, stream, 40)
    assert sorted(order) == list(range(12))
    for row, d in enumerate(order):
        n = int(lengths[d])
        alone = to_batch(stream.read(starts[d], starts[d] + n)[None], None,
                         masks.read(starts[d], starts[d] + n)[None], loss_select("auto"))
        assert torch.equal(batch.loss_mask[row, :n - 1], alone.loss_mask[0])
        assert torch.equal(batch.targets[row, :n - 1], alone.targets[0])
        assert not batch.loss_mask[row, n - 1:].any()
    report = padding_report([stream], 40)
    assert report.truncated == 0 and report.targets == int((lengths - 1).sum())
    assert abs(report.waste - (1 - (lengths - 1).sum() / (12 * 40))) < 1e-12
