"""Samples and batches: how a split's token stream is cut into samples and how samples become a
`Batch` (inputs, targets, positions, loss mask); data/loader.py decides which samples each rank
reads and when.

Packing. prepare writes every document followed by one EOS, back to back, so a source's split is
one stream `doc0 EOS doc1 EOS ...` (the model learns where documents end; no token is padding).
The stream is cut into samples of seq_len + 1 tokens that overlap by one token:

    sample i = stream[i*T : i*T + T + 1]      inputs = sample[:-1], targets = sample[1:]

Samples cross document boundaries. With `packing="concat"` nothing marks them (the usual choice
for pretraining). With `packing="document"` the batch also carries `positions` (B, T): 0 at the
window's first token and at every token that follows an EOS, counting up from there; the model
then restarts RoPE positions and stops attention at those boundaries (model/llama.py).

With `packing="pad"` a sample is one document instead (fine-tuning on conversations): sample i
is document i of the stream (its EOS included), right-padded to seq_len + 1 tokens:

    sample i = doc_i[:T + 1] + [pad] * (T + 1 - len(doc_i))      (pad: the EOS id)

Its targets past the document's last token are never trained (the loss mask is 0 there), and
under causal attention the document's tokens, which come first, never see the padding; no
`positions` are needed, each row starts at position 0. A document longer than T + 1 tokens is
cut to its first T + 1 (its later targets are not trained): `PaddingReport` counts them and
the waste, the share of the B x T positions whose target is padding; the pre-flight prints it.

A padded micro-batch is then cut after its last trained target (`trim_padding`), rounded up to
a multiple (8, times tp where sequence parallel splits the columns), as Hugging Face collators pad
to the batch's longest row: the columns cut hold only padding and untrained tokens that no earlier
position attends to (causal), so the loss and every gradient are those of the uncut batch, for
less work. Pipelines keep seq_len (their stages' shapes are fixed).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from trainbook.data.chat import DOC_START, LAST, TRAINED
from trainbook.data.shards import TokenStream
from trainbook.errors import TrainbookError

PACKINGS = ("concat", "document", "pad")


class Batch(NamedTuple):
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64, inputs shifted by one
    positions: torch.Tensor | None = None  # (B, T) int64 for document packing, else None
    sources: torch.Tensor | None = None  # (B,) int64: each row's training source (recipe order)
    loss_mask: torch.Tensor | None = None  # (B, T) bool: the targets trained (fine-tuning), else None: all


def num_samples(stream: TokenStream, seq_len: int, packing: str = "concat") -> int:
    """Samples of seq_len + 1 tokens (overlapping by one) that fit in the stream; with pad
    packing, its documents."""
    if packing == "pad":
        return len(stream.documents()[0])
    return max(0, (len(stream) - 1) // seq_len)


def read_samples(stream: TokenStream, masks: TokenStream | None, sample_ids: np.ndarray, seq_len: int,
                 pad_id: int | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Samples `sample_ids` (B,) as (tokens (B, T+1), mask bytes (B, T+1) or None, lengths):
    windows of the stream (`pad_id` None; lengths None), or documents right-padded with
    `pad_id` (pad packing; lengths (B,): each row's real tokens, at most T + 1)."""
    if pad_id is None:
        starts = sample_ids * seq_len
        return (stream.take(starts, seq_len + 1),
                None if masks is None else masks.take(starts, seq_len + 1), None)
    doc_starts, doc_lengths = stream.documents()
    starts, lengths = doc_starts[sample_ids], np.minimum(doc_lengths[sample_ids], seq_len + 1)  # (B,)
    real = np.arange(seq_len + 1) < lengths[:, None]  # (B, T+1)
    positions = np.where(real, starts[:, None] + np.arange(seq_len + 1), starts[:, None])
    tokens = np.where(real, stream.gather(positions), pad_id)
    bits = None if masks is None else np.where(real, masks.gather(positions), 0).astype(np.uint8)
    return tokens, bits, lengths


def document_positions(inputs: np.ndarray, eos_id: int, bits: np.ndarray | None = None) -> np.ndarray:
    """Position of each token in its document, restarting after every EOS (with chat data's
    mask `bits` (B, T): at every `DOC_START`, since a chat model's EOS may end a turn): (B, T) int64."""
    _, seq_len = inputs.shape
    arange = np.arange(seq_len, dtype=np.int64)
    starts = np.zeros(inputs.shape, dtype=bool)  # (B, T): token begins a document (or the window)
    if bits is not None:
        starts[:] = (bits & DOC_START) != 0
    else:
        starts[:, 1:] = inputs[:, :-1] == eos_id
    starts[:, 0] = True
    # The index of the latest start at or before each token, by a running maximum.
    last_start = np.maximum.accumulate(np.where(starts, arange, 0), axis=1)
    return arange - last_start


def loss_select(loss_on: str) -> int:
    """`train.loss_on` -> the mask bit its targets carry (0: every target). `TRAINED` marks the
    assistant turns of chat data, the completion of prompt_completion data and every token of
    text, so `auto`, `assistant` and `completion` all select it (resolution checks that the
    sources have what `loss_on` names)."""
    return {"all": 0, "last_assistant": LAST}.get(loss_on, TRAINED)


def loss_mask(bits: np.ndarray, select: int, lengths: np.ndarray | None = None) -> np.ndarray:
    """Mask bytes (B, T+1) -> the trained targets (B, T) bool: those carrying `select` (0: all),
    never the first token of a document (no label crosses into the next one), and with pad
    packing's `lengths` (B,) never a target past a row's real tokens (padding)."""
    target = bits[:, 1:]
    trained = (target & select) != 0 if select else np.ones(target.shape, dtype=bool)
    trained &= (target & DOC_START) == 0
    if lengths is not None:
        trained &= np.arange(1, target.shape[1] + 1) < lengths[:, None]
    return trained


def to_batch(tokens: np.ndarray, eos_id: int | None, bits: np.ndarray | None = None, select: int = TRAINED,
             lengths: np.ndarray | None = None) -> Batch:
    """tokens (B, T+1) -> Batch; positions when `eos_id` is given (document packing); the loss
    mask when chat data's mask `bits` (B, T+1) are, padding excluded by pad packing's `lengths`."""
    tokens = np.asarray(tokens, dtype=np.int64)
    positions = None if eos_id is None else torch.from_numpy(
        document_positions(tokens[:, :-1], eos_id, None if bits is None else bits[:, :-1]))
    if bits is None and lengths is not None:  # every real target of text is trained
        bits = np.full(tokens.shape, TRAINED | LAST, dtype=np.uint8)
    mask = None if bits is None else torch.from_numpy(loss_mask(bits, select, lengths))
    tokens = torch.from_numpy(tokens)
    # Two contiguous tensors rather than two strided views of one: callers may .view() them.
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), positions, loss_mask=mask)


def trim_padding(batch: Batch, multiple: int) -> Batch:
    """`batch` without the columns after its last trained target (any row), the kept width
    rounded up to `multiple` (at most the batch's own); the same batch when nothing can go."""
    if batch.loss_mask is None:
        return batch
    trained = torch.nonzero(batch.loss_mask.any(dim=0))
    width = batch.inputs.shape[1]
    keep = min(width, -(-(int(trained[-1]) + 1 if len(trained) else 1) // multiple) * multiple)
    if keep == width:
        return batch
    cut = lambda t: None if t is None else t[:, :keep].contiguous()  # noqa: E731
    return batch._replace(inputs=cut(batch.inputs), targets=cut(batch.targets), positions=cut(batch.positions),
                          loss_mask=cut(batch.loss_mask))


def make_batch(
    stream: TokenStream, sample_ids: np.ndarray, seq_len: int, eos_id: int | None = None,
    masks: TokenStream | None = None, select: int = TRAINED, pad_id: int | None = None,
) -> Batch:
    """Read samples `sample_ids` (shape (B,)) of one stream (and its mask bytes) as a Batch;
    documents padded with `pad_id` when it is given (pad packing)."""
    tokens, bits, lengths = read_samples(stream, masks, sample_ids, seq_len, pad_id)  # (B, T+1)
    return to_batch(tokens, eos_id, bits, select, lengths)


class PaddingReport(NamedTuple):
    """Pad packing over documents, each once: how many positions are padding, how many cut."""

    documents: int
    seq_len: int
    targets: int
    """Real targets in the samples: sum of min(len - 1, T) (a document's last token has none)."""
    truncated: int
    """Documents longer than T + 1 tokens, cut to their first T + 1."""
    cut: int
    """Targets those documents lose (never trained)."""

    @property
    def waste(self) -> float:
        """The share of the samples' positions (documents x T) whose target is padding."""
        return 1.0 - self.targets / (self.documents * self.seq_len) if self.documents else 0.0

    def line(self) -> str:
        cut = (f"; {self.truncated:,} longer than seq_len + 1 = {self.seq_len + 1} tokens are cut there, "
               f"{self.cut:,} targets never trained (raise train.seq_len to keep them)") if self.truncated else ""
        return (f"pad packing: {self.documents:,} documents padded to seq_len {self.seq_len}: "
                f"{self.waste:.1%} of positions are padding{cut}")


def padding_report(streams: list[TokenStream], seq_len: int) -> PaddingReport:
    """`PaddingReport` of every document of `streams`, each once (one epoch of each source)."""
    lengths = np.concatenate([np.zeros(0, dtype=np.int64)] + [s.documents()[1] for s in streams])  # (D,)
    targets = lengths - 1
    over = targets > seq_len
    return PaddingReport(len(lengths), seq_len, int(np.minimum(targets, seq_len).sum()), int(over.sum()),
                         int((targets[over] - seq_len).sum()))


def check_train_split(streams: dict[str, TokenStream], seq_len: int, micro_batch_size: int,
                      world_size: int, packing: str = "concat") -> dict[str, int]:
    """Samples per source; an error when a source has none or all together hold fewer than one
    batch of `world_size` data-parallel ranks (the pre-flight calls it before any process starts)."""
    samples = {name: num_samples(stream, seq_len, packing) for name, stream in streams.items()}
    for name, n in samples.items():
        if n == 0:
            raise TrainbookError(
                f"source '{name}' has {len(streams[name])} train tokens, less than one sample"
                f" of seq_len + 1 = {seq_len + 1}; use a shorter seq_len or more data",
                where="train.seq_len",
            )
    total, step_samples = sum(samples.values()), micro_batch_size * world_size
    if total < step_samples:
        raise TrainbookError(
            f"the train split has {total} samples of seq_len + 1 = {seq_len + 1} tokens, "
            f"fewer than one batch of {step_samples} (micro_batch_size "
            f"{micro_batch_size} x {world_size} ranks); use a shorter seq_len, a smaller "
            "batch or more data",
            where="train.seq_len",
        )
    return samples


def check_val_split(stream: TokenStream, seq_len: int, packing: str = "concat") -> int:
    """Samples in the validation split; an error when it holds none."""
    n = num_samples(stream, seq_len, packing)
    if n == 0:
        raise TrainbookError(
            f"the validation split has {len(stream)} tokens, less than one sample of seq_len + 1"
            f" = {seq_len + 1}; raise data.val_fraction or lower train.seq_len",
            where="data.val_fraction",
        )
    return n


def check_packing(packing: str, eos_id: int | None) -> None:
    if packing not in PACKINGS:
        raise TrainbookError(f"unknown packing '{packing}' (one of {PACKINGS})", where="data.packing")
    if packing in ("document", "pad") and eos_id is None:
        raise TrainbookError(f"{packing} packing needs the tokenizer's EOS id", where="data.packing")
