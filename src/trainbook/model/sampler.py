"""Rollouts: completions for a batch of prompts, behind one small protocol.

`RolloutEngine` is the seam: `generate(prompts, seeds, params) -> completions`. Evaluation
(`trainbook eval`) and reinforcement learning ask it for completions and know nothing else of how
they were made. `LocalSampler` is the built-in engine: the run's own model (whatever its layout:
under FSDP2 the same sharded weights, under tensor parallel each rank its heads), batched, with a
KV cache (model/kv_cache.py). An inference engine beside the trainer would be another
implementation of the same protocol.

Each completion draws from its own generator seeded with its own seed, so what a completion
samples does not depend on which other prompts share its batch or in what order they come (the
logits themselves may differ in their last bits between batch shapes). Greedy decoding
(temperature 0) draws nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from trainbook.errors import TrainbookError
from trainbook.model.kv_cache import KVCache


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None  # None or 0: the whole vocabulary
    top_p: float = 1.0
    stop_ids: Collection[int] = field(default_factory=frozenset)  # EOS, a template's end of turn

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise TrainbookError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}", where="max_new_tokens")
        if self.temperature < 0:
            raise TrainbookError(f"temperature must be >= 0, got {self.temperature}", where="temperature")
        if not 0 < self.top_p <= 1:
            raise TrainbookError(f"top_p must be in (0, 1], got {self.top_p}", where="top_p")


@dataclass(frozen=True)
class Completion:
    ids: list[int]  # the new tokens, the stopping token included when one came
    stopped: bool  # ended on a stop id; False: ran to max_new_tokens (truncated)


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[Completion]:
        """One completion per prompt, in order; completion i draws from a generator seeded with
        seeds[i]. `progress(n)` is called with the number of completions finished so far."""
        ...


class LocalSampler:
    """The built-in engine: `batch_size` prompts at a time through `model` with a KV cache.

    Prompts are left-padded to the longest of their batch; every row then writes its next token
    to the same cache slot. A batch ends when every row has stopped or reached max_new_tokens.

    Under FSDP or tensor parallel every rank must run the same forwards: `agree(done)` is then
    given whether this rank's batch is done and returns whether every rank's is (an all-reduce),
    and every rank must ask for the same number of prompts.

    `multiple_of` > 1 makes every forward's length a multiple of it, as tensor parallelism's
    sequence sharding needs (the residual stream is split along the sequence over the tp ranks):
    prompts get more left padding, and a decoding step writes filler slots before its token (the
    model returns the last slot's logits), marked invalid so that no later token attends to them. The sampled tokens are those of
    `multiple_of` = 1 up to the float differences of the layout.
    """

    def __init__(self, model: nn.Module, batch_size: int = 64, pad_id: int = 0,
                 agree: Callable[[bool], bool] | None = None, multiple_of: int = 1):
        if getattr(model, "tok_embeddings", None) is None or getattr(model, "output", None) is None:
            raise TrainbookError("generation needs the whole model: a pipeline stage cannot sample", where="parallel.pp")
        self.model, self.batch_size, self.pad_id = model, batch_size, pad_id
        self.agree = agree or (lambda done: done)
        self.width = multiple_of

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[Completion]:
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        limit = self.model.cfg.max_seq_len
        for i, p in enumerate(prompts):
            if not p:
                raise TrainbookError(f"prompt {i} is empty: generation needs at least one token", where="prompt")
            if len(p) + params.max_new_tokens > limit:
                raise TrainbookError(
                    f"prompt {i} has {len(p)} tokens: with max_new_tokens={params.max_new_tokens} it needs "
                    f"{len(p) + params.max_new_tokens} positions, more than the model's max_seq_len={limit}",
                    where="max_new_tokens")
        out: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompts), self.batch_size):
                end = start + self.batch_size
                out += self._batch(prompts[start:end], seeds[start:end], params)
                if progress is not None:
                    progress(len(out))
        finally:
            self.model.train(was_training)
        return out

    @torch.no_grad()
    def _batch(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams) -> list[Completion]:
        device = next(self.model.parameters()).device
        w = self.width
        rows, longest = len(prompts), -(-max(len(p) for p in prompts) // w) * w
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        tokens = torch.full((rows, longest), self.pad_id, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            tokens[i, longest - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
        # Slots: the left-padded prompts, then `w` a decoding step, of which the last is its token.
        slots = torch.arange(longest + (params.max_new_tokens - 1) * w, device=device)
        valid = (slots[None, :] >= (longest - lengths)[:, None]) & ((slots < longest) | ((slots - longest) % w == w - 1))
        positions = (slots[None, :longest] - (longest - lengths)[:, None]).clamp(min=0)  # (B, longest)
        cache = KVCache(valid)
        filler = torch.full((rows, w - 1), self.pad_id, dtype=torch.long, device=device)
        generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        stop = torch.tensor(sorted(params.stop_ids), dtype=torch.long, device=device)

        new = torch.empty(rows, 0, dtype=torch.long, device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        logits = self.model(tokens, positions, cache=cache)[:, -1].float()  # (B, vocab)
        for t in range(params.max_new_tokens):
            picked = pick(logits, params, generators, done)  # (B,)
            new = torch.cat([new, picked[:, None]], dim=1)
            done |= torch.isin(picked, stop)
            if self.agree(bool(done.all())) or t + 1 == params.max_new_tokens:
                break
            step = torch.cat([filler, picked[:, None]], dim=1)  # (B, w)
            where = (lengths + t)[:, None].expand(rows, w)
            logits = self.model(step, where, cache=cache)[:, -1].float()

        out = []
        for i, row in enumerate(new.tolist()):
            ends = [j for j, x in enumerate(row) if x in params.stop_ids]
            out.append(Completion(row[: ends[0] + 1], True) if ends else Completion(row, False))
        return out


def pick(logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator],
         skip: torch.Tensor | None = None) -> torch.Tensor:
    """Next token of each row of logits (B, vocab): argmax at temperature 0, else a draw from
    softmax(logits / temperature) cut to the top_k tokens and to the smallest set whose
    probability reaches top_p (the most likely token always kept). Row i draws from
    generators[i]; rows in `skip` (finished) draw nothing and get their argmax."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of the tokens above each
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    out = logits.argmax(dim=-1)
    finished = skip.tolist() if skip is not None else [False] * len(generators)
    for i, g in enumerate(generators):
        if not finished[i]:
            out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return out
