"""Packing and loading: from each source's token stream to (inputs, targets[, positions]) batches.

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

Order. `mixture.MixtureOrder` maps every global sample index g to (source, sample) as a pure
function of (weights, source sizes, seed): weighted stride-scheduled interleave of the sources,
a fresh seeded permutation per epoch of each source (see its module docstring). Each batch
names the source of every row (`Batch.sources`), so the trainer counts the mixture training
really took (`DeliveredMix`), not the one planned.

Data parallel. Micro-batch k of rank r is global samples [(k * world_size + r) * B, + B): ranks
are disjoint and together complete. The whole state is `consumed`, the global samples taken by
all ranks (the same number on every rank), so a run resumed at another world size, or another
micro-batch size, continues with exactly the next unseen global samples.

Assembly. A batch is one vectorised read per source from the memory-mapped shards
(B x (T+1) positions, numpy fancy indexing) plus one dtype conversion; with `num_workers > 0`
background processes (a torch DataLoader over a map-style dataset indexed by the batch's first
global sample) assemble the same batches in the same order, and prefetching never moves the
state: `consumed` counts what the caller took.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainbook.data.chat import DOC_START, LAST, TRAINED
from trainbook.data.mixture import MixtureOrder
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


def make_batch(
    stream: TokenStream, sample_ids: np.ndarray, seq_len: int, eos_id: int | None = None,
    masks: TokenStream | None = None, select: int = TRAINED, pad_id: int | None = None,
) -> Batch:
    """Read samples `sample_ids` (shape (B,)) of one stream (and its mask bytes) as a Batch;
    documents padded with `pad_id` when it is given (pad packing)."""
    tokens, bits, lengths = read_samples(stream, masks, sample_ids, seq_len, pad_id)  # (B, T+1)
    return to_batch(tokens, eos_id, bits, select, lengths)


WORKER_ITEM_TOKENS = 1 << 16


class BatchReader(Dataset):
    """Map-style dataset: `reader[base]` is the micro-batch of `rank` in the group of
    `world_size` micro-batches that starts at global sample `base`. Stateless, so worker
    processes (which hold copies) never need to be told where the loader is."""

    def __init__(self, streams: dict[str, TokenStream], order: MixtureOrder, seq_len: int,
                 micro_batch_size: int, rank: int, eos_id: int | None,
                 masks: dict[str, TokenStream] | None = None, select: int = TRAINED,
                 pad_id: int | None = None):
        self.streams = list(streams.values())  # in `order.names` order
        self.pad_id = pad_id  # pad packing: samples are documents padded with it
        self.masks = None if masks is None else [masks[name] for name in streams]
        self.select = select
        self.order = order
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.eos_id = eos_id

    def __getitem__(self, base: int) -> Batch:
        lo = base + self.rank * self.micro_batch_size
        source, ids = self.order.sample_ids(np.arange(lo, lo + self.micro_batch_size))  # (B,) each
        tokens = np.empty((self.micro_batch_size, self.seq_len + 1), dtype=np.int64)
        bits = None if self.masks is None else np.empty(tokens.shape, dtype=np.uint8)
        lengths = None if self.pad_id is None else np.empty(self.micro_batch_size, dtype=np.int64)
        for s in np.unique(source):  # one fancy-index read per source in the batch
            rows = source == s
            masks = None if bits is None else self.masks[s]
            tokens[rows], mask_bits, row_lengths = read_samples(self.streams[s], masks, ids[rows], self.seq_len,
                                                                self.pad_id)
            if bits is not None:
                bits[rows] = mask_bits
            if lengths is not None:
                lengths[rows] = row_lengths
        batch = to_batch(tokens, self.eos_id, bits, self.select, lengths)
        return batch._replace(sources=torch.from_numpy(source))

    def __len__(self) -> int:  # endless in practice; DataLoader asks only for the sampler's items
        return 1 << 62

    # Pickled (spawn/forkserver workers) as shard paths, not as copies of the memory maps.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "streams": [s.paths for s in self.streams],
                "masks": None if self.masks is None else [m.paths for m in self.masks]}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.streams = [TokenStream(paths) for paths in state["streams"]]
        self.masks = None if state["masks"] is None else [TokenStream(paths) for paths in state["masks"]]


class _BatchGroups(Dataset):
    """Worker items: `group` consecutive batches of this rank stacked into one (G, B, T) Batch.

    Handing a worker's output to the training process costs about the same for a small batch
    as for a large one, so workers send several batches at a time.
    """

    def __init__(self, reader: BatchReader, group: int, step: int):
        self.reader = reader
        self.group = group
        self.step = step

    def __getitem__(self, base: int) -> Batch:
        batches = [self.reader[base + i * self.step] for i in range(self.group)]
        return Batch(*(None if parts[0] is None else torch.stack(parts) for parts in zip(*batches)))

    def __len__(self) -> int:
        return 1 << 62


class _Bases:
    """The sampler: first global sample of each of this rank's next batches, from `start`."""

    def __init__(self, step: int):
        self.step = step
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.count(self.start, self.step)


class TrainLoader:
    """An endless iterator of training Batches over a weighted mixture, resumable at any world size.

    `on_reepoch(source, epoch)` is called when the run (all ranks together) takes the first
    sample of a source's epoch >= 1, on every rank alike.
    """

    def __init__(
        self,
        streams: dict[str, TokenStream],
        weights: dict[str, float],
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        packing: str = "concat",
        eos_id: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
        on_reepoch: Callable[[str, int], None] | None = None,
        masks: dict[str, TokenStream] | None = None,
        loss_on: str = "auto",
    ):
        assert 0 <= rank < world_size, (rank, world_size)
        _check_packing(packing, eos_id)
        if set(streams) != set(weights):
            raise TrainbookError(
                f"train streams {sorted(streams)} and source weights {sorted(weights)} name "
                "different sources", where="data.sources",
            )
        self.names = list(streams)  # recipe order
        self.samples = check_train_split(streams, seq_len, micro_batch_size, world_size, packing)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self._step_samples = micro_batch_size * world_size  # global samples per batch, all ranks
        self.order = MixtureOrder(
            self.names, [float(weights[n]) for n in self.names],
            [self.samples[n] for n in self.names], seed,
        )
        self.reader = BatchReader(streams, self.order, seq_len, micro_batch_size, rank,
                                  eos_id if packing == "document" else None, masks,
                                  loss_select(loss_on), eos_id if packing == "pad" else None)
        if pin_memory and not torch.accelerator.is_available():
            warnings.warn("pin_memory=True has no effect without an accelerator", stacklevel=2)
            pin_memory = False
        self.pin_memory = pin_memory
        self.on_reepoch = on_reepoch
        # Batches per worker item: about WORKER_ITEM_TOKENS tokens, so the hand-off is amortised.
        self._group = max(1, WORKER_ITEM_TOKENS // (micro_batch_size * seq_len))
        self._bases = _Bases(self._step_samples * self._group)
        self._workers = None if num_workers == 0 else DataLoader(
            _BatchGroups(self.reader, self._group, self._step_samples), batch_size=None,
            sampler=self._bases, num_workers=num_workers, pin_memory=pin_memory,
            prefetch_factor=prefetch_factor, persistent_workers=True,
        )
        self._worker_iter: Iterator[Batch] | None = None
        self._pending: list[Batch] = []  # the rest of the current worker item, in order
        self._skipped: list[tuple[int, int]] = []  # windows of global samples never delivered (`skip`)
        self.last_base = 0  # where the last batch was read: its ranks' rows start at this global sample
        self.load_state_dict({"consumed": 0})

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        self._jump_skipped()
        self.last_base = self.consumed
        if self._workers is None:
            batch = self.reader[self.consumed]
            if self.pin_memory:
                batch = Batch(*(None if t is None else t.pin_memory() for t in batch))
        else:
            if self._worker_iter is None:  # (re)start the workers' stream at the position
                self._bases.start = self.consumed
                self._worker_iter = iter(self._workers)
                self._pending = []
            if not self._pending:
                group = next(self._worker_iter)  # (G, B, T) each
                self._pending = [Batch(*(None if t is None else t[i] for t in group))
                                 for i in range(self._group)][::-1]
            batch = self._pending.pop()
        self.consumed += self._step_samples
        self._report_reepochs()
        return batch

    def _report_reepochs(self) -> None:
        epochs = self.order.epochs_started(self.consumed)  # (S,)
        if self.on_reepoch is not None:
            for s in np.flatnonzero(epochs > self._epochs):
                for epoch in range(max(1, int(self._epochs[s]) + 1), int(epochs[s]) + 1):
                    self.on_reepoch(self.names[s], epoch)
        self._epochs = epochs

    def skip(self, start: int, end: int) -> None:
        """Never deliver global samples [start, end): reaching `start`, the loader continues at
        `end` (a rollback's skipped window; data is never replayed into it after a resume)."""
        if (start, end) not in self._skipped:
            self._skipped.append((start, end))

    def _jump_skipped(self) -> None:
        for start, end in self._skipped:
            if start <= self.consumed < end:
                self.consumed = end
                self._epochs = self.order.epochs_started(self.consumed)
                self._worker_iter = None  # batches prefetched from inside the window are dropped

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after the first `consumed` global samples (whatever world size took them)."""
        self.consumed = int(state["consumed"])
        self._epochs = self.order.epochs_started(self.consumed)
        self._worker_iter = None  # batches prefetched from the old position are dropped

    def mixture_share(self, rows: np.ndarray) -> dict[str, dict[str, float]]:
        """Per source: its target share (from the weights) and its `actual` share of `rows`, the
        rows of each source (S,) that training took (counted by `DeliveredMix`)."""
        weights = self.order.weights / self.order.weights.sum()
        total = int(rows.sum())
        return {
            name: {"target": float(w), "actual": float(n / total) if total else 0.0, "rows": int(n)}
            for name, w, n in zip(self.names, weights, rows)
        }

    def close(self) -> None:
        """Stop the worker processes (they also stop when the loader is garbage-collected)."""
        self._worker_iter = None
        self._workers = None


class DeliveredMix:
    """Passes batches through, counting the rows of each training source among them: what the
    step really took, after everything between the loader and the step (not the planned order).
    `take()` returns the counts (S,) since the last call."""

    def __init__(self, batches: Iterator[Batch], num_sources: int):
        self.batches = batches
        self.rows = np.zeros(num_sources, dtype=np.int64)

    def __iter__(self) -> DeliveredMix:
        return self

    def __next__(self) -> Batch:
        batch = next(self.batches)
        if batch.sources is not None:
            self.rows += np.bincount(batch.sources.numpy(), minlength=len(self.rows))
        return batch

    def take(self) -> np.ndarray:
        rows, self.rows = self.rows, np.zeros_like(self.rows)
        return rows


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


def _check_packing(packing: str, eos_id: int | None) -> None:
    if packing not in PACKINGS:
        raise TrainbookError(f"unknown packing '{packing}' (one of {PACKINGS})", where="data.packing")
    if packing in ("document", "pad") and eos_id is None:
        raise TrainbookError(f"{packing} packing needs the tokenizer's EOS id", where="data.packing")


def val_batches(
    stream: TokenStream, seq_len: int, micro_batch_size: int, n_batches: int,
    packing: str = "concat", *, eos_id: int | None = None, masks: TokenStream | None = None,
    loss_on: str = "auto",
) -> Iterator[Batch]:
    """The first `n_batches` validation batches, the same ones in the same order every call.

    Samples are taken in stream order (0, 1, 2, ...), wrapping around to the start when the
    split has fewer than `n_batches * micro_batch_size` samples, so evaluations are comparable
    across steps and runs. `packing="document"` adds positions, as for training; `"pad"` takes
    the documents in order, padded.
    """
    _check_packing(packing, eos_id)
    n = check_val_split(stream, seq_len, packing)  # here, not on the first next(): the call that set it up
    return _val_batches(stream, seq_len, micro_batch_size, n_batches, n,
                        eos_id if packing == "document" else None, masks, loss_select(loss_on),
                        eos_id if packing == "pad" else None)


def _val_batches(
    stream: TokenStream, seq_len: int, micro_batch_size: int, n_batches: int, n: int,
    eos_id: int | None, masks: TokenStream | None, select: int, pad_id: int | None,
) -> Iterator[Batch]:
    for b in range(n_batches):
        sample_ids = np.arange(b * micro_batch_size, (b + 1) * micro_batch_size) % n  # (B,)
        yield make_batch(stream, sample_ids, seq_len, eos_id, masks, select, pad_id)
