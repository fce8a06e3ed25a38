"""Sampling one continuation (`trainbook sample`): temperature + top-k, deterministic for a seed.

No KV cache: each new token reruns the model over the context, cropped to its last max_seq_len
tokens, so a continuation may run past the model's context. That is O(T^2) per sample but
trivially correct. Batched generation with a KV cache, for evaluation and rollouts, is
model/sampler.py (it picks tokens the same way: `sampler.pick`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from trainbook.errors import TrainbookError
from trainbook.model.sampler import SamplingParams, pick


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    eos_id: int | None = None,
    stop_ids: Collection[int] = (),
) -> list[int]:
    """The new token ids only (not the prompt), stopping after `eos_id` or any of `stop_ids` (a
    chat template's end-of-turn token) if one appears, that token included.

    `temperature=0` is greedy (argmax); `top_k=None` or 0 samples from the whole vocabulary. The
    model sees at most its last `max_seq_len` tokens. Sampling draws from a private generator, so
    the result depends only on the model, prompt and seed, and the global RNG is untouched.
    The model runs in eval mode and is put back in the mode it was in.
    """
    if not prompt_ids:
        raise TrainbookError("generation needs a prompt of at least one token", where="prompt")
    if temperature < 0:
        raise TrainbookError(f"temperature must be >= 0, got {temperature}", where="temperature")
    device = next(model.parameters()).device
    max_seq_len = model.cfg.max_seq_len
    generator = torch.Generator(device=device).manual_seed(seed)
    params = SamplingParams(max(max_new_tokens, 1), temperature, top_k)

    ids = list(prompt_ids)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = torch.tensor([ids[-max_seq_len:]], device=device)  # (1, T)
            logits = model(context)[0, -1].float()  # (vocab,) at the last position
            next_id = int(pick(logits[None], params, [generator])[0])
            ids.append(next_id)
            if next_id == eos_id or next_id in stop_ids:
                break
    finally:
        model.train(was_training)
    return ids[len(prompt_ids) :]
