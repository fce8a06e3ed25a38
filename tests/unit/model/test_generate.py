"""Sampling: deterministic for a seed, greedy is argmax, eos stops, the context is cropped."""

import pytest
import torch

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model import build_model, generate

PROMPT = [5, 17, 42, 7]


@pytest.fixture(scope="module")
def model():
    # A short max_seq_len so the cropping path runs within a few steps.
    return build_model(ModelConfig(name="debug", max_seq_len=16), "cpu", seed=0)


def greedy_reference(model, ids, steps):
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids[-model.cfg.max_seq_len :]]))
            ids.append(int(logits[0, -1].argmax()))
            out.append(ids[-1])
    return out


def test_same_seed_same_tokens_different_seed_different(model):
    a = generate(model, PROMPT, 20, temperature=1.0, top_k=None, seed=1)
    b = generate(model, PROMPT, 20, temperature=1.0, top_k=None, seed=1)
    c = generate(model, PROMPT, 20, temperature=1.0, top_k=None, seed=2)
    assert a == b and a != c
    assert len(a) == 20 and all(0 <= t < 512 for t in a)


def test_greedy_is_argmax_of_the_logits_past_the_context_limit(model):
    # 4 prompt + 20 new tokens > max_seq_len = 16: later steps see a cropped context.
    assert generate(model, PROMPT, 20, temperature=0) == greedy_reference(model, PROMPT, 20)


def test_top_k_1_is_greedy(model):
    assert generate(model, PROMPT, 8, temperature=1.0, top_k=1, seed=3) == generate(
        model, PROMPT, 8, temperature=0
    )


def test_stops_after_eos(model):
    first = generate(model, PROMPT, 5, temperature=0)[0]
    assert generate(model, PROMPT, 5, temperature=0, eos_id=first) == [first]


def test_leaves_global_rng_and_training_mode_alone(model):
    model.train()
    before = torch.get_rng_state()
    generate(model, PROMPT, 5, seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    assert model.training


def test_empty_prompt_is_a_user_error(model):
    with pytest.raises(TrainbookError):
        generate(model, [], 5)
