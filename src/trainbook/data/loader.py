"""Loading: from each source's token stream to batches, in a seeded order, on every rank.

How a stream is cut into samples (concat, document and pad packing) and how samples become a
`Batch` is data/samples.py.

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

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainbook.data.chat import TRAINED
from trainbook.data.mixture import MixtureOrder
from trainbook.data.samples import (
    Batch, check_packing, check_train_split, check_val_split, loss_select, make_batch, read_samples, to_batch, trim_padding,
)
from trainbook.data.shards import TokenStream
from trainbook.errors import TrainbookError



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
        pad_multiple: int = 0,
    ):
        """`pad_multiple`: pad packing's micro-batches are cut after their last trained target,
        their width rounded up to this (`samples.trim_padding`); 0 keeps seq_len."""
        assert 0 <= rank < world_size, (rank, world_size)
        check_packing(packing, eos_id)
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
        self.pad_multiple = pad_multiple if packing == "pad" else 0
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
            batch = self._trimmed(self.reader[self.consumed])
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
            trimmed = self._trimmed(batch)
            if trimmed is not batch and self.pin_memory:  # the cut is a copy: pinned again
                trimmed = Batch(*(None if t is None else t.pin_memory() for t in trimmed))
            batch = trimmed
        self.consumed += self._step_samples
        self._report_reepochs()
        return batch

    def _trimmed(self, batch: Batch) -> Batch:
        return trim_padding(batch, self.pad_multiple) if self.pad_multiple else batch

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


def val_batches(
    stream: TokenStream, seq_len: int, micro_batch_size: int, n_batches: int,
    packing: str = "concat", *, eos_id: int | None = None, masks: TokenStream | None = None,
    loss_on: str = "auto", pad_multiple: int = 0,
) -> Iterator[Batch]:
    """The first `n_batches` validation batches, the same ones in the same order every call.

    Samples are taken in stream order (0, 1, 2, ...), wrapping around to the start when the
    split has fewer than `n_batches * micro_batch_size` samples, so evaluations are comparable
    across steps and runs. `packing="document"` adds positions, as for training; `"pad"` takes
    the documents in order, padded (and cut as training's are with `pad_multiple`).
    """
    check_packing(packing, eos_id)
    n = check_val_split(stream, seq_len, packing)  # here, not on the first next(): the call that set it up
    return _val_batches(stream, seq_len, micro_batch_size, n_batches, n,
                        eos_id if packing == "document" else None, masks, loss_select(loss_on),
                        eos_id if packing == "pad" else None, pad_multiple if packing == "pad" else 0)


def _val_batches(
    stream: TokenStream, seq_len: int, micro_batch_size: int, n_batches: int, n: int,
    eos_id: int | None, masks: TokenStream | None, select: int, pad_id: int | None, pad_multiple: int,
) -> Iterator[Batch]:
    for b in range(n_batches):
        sample_ids = np.arange(b * micro_batch_size, (b + 1) * micro_batch_size) % n  # (B,)
        batch = make_batch(stream, sample_ids, seq_len, eos_id, masks, select, pad_id)
        yield trim_padding(batch, pad_multiple) if pad_multiple else batch
