"""Packing and loading: from a split's token stream to (inputs, targets) batches.

Packing. prepare writes every document followed by one EOS, back to back, so a split is one
stream `doc0 EOS doc1 EOS ...` (the model learns where documents end, and no token is padding).
The stream is cut into samples of seq_len + 1 tokens that overlap by one token:

    sample i = stream[i*T : i*T + T + 1]      inputs = sample[:-1], targets = sample[1:]

so each token is a target at most once per epoch (not: the first token, a tail too short for a
sample, and the samples left over after the epoch's last full batch). Samples cross document
boundaries: nothing here masks attention at EOS (the usual choice for pretraining).

Loading. `TrainLoader` visits the samples in a fresh permutation each epoch, drawn from a
torch.Generator seeded with `seed + epoch`: the order depends only on (seed, epoch), so the
position {"epoch", "index"} is the whole state, and resuming from it gives bitwise the batches
an uninterrupted run would have seen. A batch is one vectorised read from the memory-mapped
shards (B x (T+1) positions) plus one dtype conversion: no Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from trainbook.data.shards import TokenStream
from trainbook.errors import TrainbookError

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets: int64, (B, T) each


def num_samples(stream: TokenStream, seq_len: int) -> int:
    """Samples of seq_len + 1 tokens (overlapping by one) that fit in the stream."""
    return max(0, (len(stream) - 1) // seq_len)


def make_batch(stream: TokenStream, sample_ids: np.ndarray, seq_len: int) -> Batch:
    """Read samples `sample_ids` (shape (B,)) and split them into inputs and targets."""
    tokens = stream.take(sample_ids * seq_len, seq_len + 1)  # (B, T+1), uint16/uint32
    tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    # Two contiguous tensors rather than two strided views of one: callers may .view() them.
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class TrainLoader:
    """An endless iterator of shuffled training batches with a resumable position.

    With `world_size` > 1 (data parallel), every rank draws the same permutation and rank r
    takes the r-th block of B samples from each group of `world_size * B`; the state is the
    same on every rank, so one rank's `state_dict()` resumes them all.
    """

    def __init__(
        self,
        stream: TokenStream,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        *,
        rank: int = 0,
        world_size: int = 1,
    ):
        assert 0 <= rank < world_size, (rank, world_size)
        self.stream = stream
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.samples_per_epoch = num_samples(stream, seq_len)
        self._step_samples = micro_batch_size * world_size  # samples consumed per batch, all ranks
        if self.samples_per_epoch < self._step_samples:
            raise TrainbookError(
                f"the train split has {len(stream)} tokens: {self.samples_per_epoch} samples of "
                f"seq_len + 1 = {seq_len + 1} tokens, fewer than one batch of "
                f"{self._step_samples} (micro_batch_size {micro_batch_size} x {world_size} ranks);"
                " use a shorter seq_len, a smaller batch or more data",
                where="train.seq_len",
            )
        # The tail of each permutation shorter than one batch is skipped (a different tail
        # each epoch, since the permutation changes).
        self.batches_per_epoch = self.samples_per_epoch // self._step_samples
        self.epoch = 0
        self.index = 0  # samples of this epoch's permutation already consumed (all ranks)
        self._order: np.ndarray | None = None  # the permutation of `self.epoch`, drawn lazily

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        if self.index + self._step_samples > self.samples_per_epoch:
            self.epoch += 1
            self.index = 0
            self._order = None
        if self._order is None:
            self._order = self._permutation(self.epoch)
        lo = self.index + self.rank * self.micro_batch_size
        sample_ids = self._order[lo : lo + self.micro_batch_size]
        self.index += self._step_samples
        return make_batch(self.stream, sample_ids, self.seq_len)

    def _permutation(self, epoch: int) -> np.ndarray:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.samples_per_epoch, generator=generator).numpy()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = None


def val_batches(
    stream: TokenStream, seq_len: int, micro_batch_size: int, n_batches: int
) -> Iterator[Batch]:
    """The first `n_batches` validation batches, the same ones in the same order every call.

    Samples are taken in stream order (0, 1, 2, ...), wrapping around to the start when the
    split has fewer than `n_batches * micro_batch_size` samples, so evaluations are comparable
    across steps and runs.
    """
    n = num_samples(stream, seq_len)
    # Checked here, not on the first next(): the error belongs to the call that set it up.
    if n == 0:
        raise TrainbookError(
            f"the validation split has {len(stream)} tokens, less than one sample of seq_len + 1"
            f" = {seq_len + 1}; raise data.val_fraction or lower train.seq_len",
            where="data.val_fraction",
        )
    return _val_batches(stream, seq_len, micro_batch_size, n_batches, n)


def _val_batches(
    stream: TokenStream, seq_len: int, micro_batch_size: int, n_batches: int, n: int
) -> Iterator[Batch]:
    for b in range(n_batches):
        sample_ids = np.arange(b * micro_batch_size, (b + 1) * micro_batch_size) % n  # (B,)
        yield make_batch(stream, sample_ids, seq_len)
