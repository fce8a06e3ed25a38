"""The batched sampler with its KV cache (model/sampler.py): left-padded prompts of uneven length
in one batch give what each prompt gives alone without a cache; cached logits equal a full
forward's; each completion's draws depend on its own seed only; stop ids, top-k and top-p; a
prompt too long for max_new_tokens is one error."""

from __future__ import annotations

import pytest
import torch

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model import build_model
from trainbook.model.kv_cache import KVCache
from trainbook.model.sampler import LocalSampler, SamplingParams

PROMPTS = [[5, 17, 42, 7], [9], [3, 3, 8, 60, 1, 2, 40], [11, 12]]
FAMILIES = {
    "llama": {},
    "qkv-bias": {"qkv_bias": True},
    "qk-norm": {"qk_norm": True, "head_dim": 32},
    # Multi-head latent attention: keys 24 wide, values 12 (a cache of two widths).
    "mla": {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 12, "n_kv_heads": 4},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="debug", max_seq_len=32, **FAMILIES[request.param]), "cpu", seed=0)
    with torch.no_grad():  # a non-zero bias, so that padding slots would show if they leaked
        for block in m.layers.values():
            for lin in (getattr(block.attention, name, None) for name in ("wq", "wk", "wv")):
                if lin is not None and lin.bias is not None:
                    lin.bias.normal_(0, 0.5)
    return m.eval()


def uncached_greedy(model, ids: list[int], steps: int) -> list[int]:
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            ids.append(out[-1])
    return out


def test_a_left_padded_batch_decodes_each_prompt_as_it_decodes_alone(model):
    sampler = LocalSampler(model, batch_size=len(PROMPTS))
    got = sampler.generate(PROMPTS, [0] * len(PROMPTS), SamplingParams(10, temperature=0))
    for prompt, completion in zip(PROMPTS, got):
        assert completion.ids == uncached_greedy(model, prompt, 10)
        assert not completion.stopped


def test_cached_logits_equal_a_full_forward(model):
    """Prefill two prompts of different lengths, then feed three more tokens one at a time: each
    step's logits equal the last position's of an uncached forward over the whole sequence."""
    prompts = [PROMPTS[0], PROMPTS[2]]
    longest = max(map(len, prompts))
    extra = [[20, 21, 22], [30, 31, 32]]
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    slots = torch.arange(longest + 3)
    cache = KVCache(slots[None, :] >= (longest - lengths)[:, None])
    positions = (slots[None, :longest] - (longest - lengths)[:, None]).clamp(min=0)
    with torch.no_grad():
        logits = model(tokens, positions, cache=cache)[:, -1]
        for t in range(3):
            for i, p in enumerate(prompts):
                full = model(torch.tensor([p + extra[i][:t]]))[0, -1]
                torch.testing.assert_close(logits[i], full, rtol=0, atol=1e-5)
            step = torch.tensor([[e[t]] for e in extra])
            logits = model(step, (lengths + t)[:, None], cache=cache)[:, -1]


def test_every_query_of_the_cache_mask_may_attend_to_something():
    """A padding slot attends to itself: never a row of the mask with nothing allowed (a kernel
    may turn it into NaN, which would then reach the real tokens through the values)."""
    lengths = torch.tensor([1, 4, 2])
    slots = torch.arange(4 + 2)
    cache = KVCache(slots[None, :] >= (4 - lengths)[:, None])
    prefill = cache.mask(4)
    assert prefill.shape == (3, 1, 4, 4) and prefill.any(-1).all()
    assert prefill[0, 0, 3].tolist() == [False, False, False, True]  # the one real token of row 0
    assert prefill[0, 0, 1].tolist() == [False, True, False, False]  # a padding slot: itself alone
    cache.advance(4)
    step = cache.mask(1)
    assert step[:, 0, 0].tolist() == [[False, False, False, True, True], [True] * 5, [False, False, True, True, True]]


def test_each_completion_draws_from_its_own_seed(model):
    params = SamplingParams(12, temperature=1.0)
    batch = LocalSampler(model, batch_size=4).generate(PROMPTS, [7, 8, 9, 10], params)
    # Alone, in another order, in batches of two: the same completions for the same seeds.
    alone = [LocalSampler(model).generate([p], [s], params)[0] for p, s in zip(PROMPTS, [7, 8, 9, 10])]
    pairs = LocalSampler(model, batch_size=2).generate(PROMPTS[::-1], [10, 9, 8, 7], params)[::-1]
    assert [c.ids for c in batch] == [c.ids for c in alone] == [c.ids for c in pairs]
    other = LocalSampler(model).generate(PROMPTS, [1, 2, 3, 4], params)
    assert [c.ids for c in other] != [c.ids for c in batch]


@pytest.mark.parametrize("width", [2, 3])
def test_forwards_padded_to_a_multiple_draw_the_same_completions(model, width):
    """Tensor parallelism's sequence sharding needs every forward's length a multiple of tp: the
    extra left padding and the filler slots after each decoded token change no draw."""
    params = SamplingParams(12, temperature=1.0)
    plain = LocalSampler(model, batch_size=4).generate(PROMPTS, [7, 8, 9, 10], params)
    padded = LocalSampler(model, batch_size=4, multiple_of=width).generate(PROMPTS, [7, 8, 9, 10], params)
    assert [c.ids for c in padded] == [c.ids for c in plain]
    greedy = LocalSampler(model, multiple_of=width).generate(PROMPTS, [0] * 4, SamplingParams(10, temperature=0))
    assert [c.ids for c in greedy] == [uncached_greedy(model, p, 10) for p in PROMPTS]


def test_a_stop_id_ends_its_row_and_is_kept(model):
    greedy = LocalSampler(model).generate(PROMPTS, [0] * 4, SamplingParams(10, temperature=0))
    stop = greedy[0].ids[3]
    got = LocalSampler(model).generate(PROMPTS, [0] * 4, SamplingParams(10, temperature=0, stop_ids={stop}))
    first = greedy[0].ids.index(stop)
    assert got[0].ids == greedy[0].ids[: first + 1] and got[0].stopped
    for g, c in zip(greedy[1:], got[1:]):  # the other rows run on, or stop where they meet it
        cut = g.ids.index(stop) + 1 if stop in g.ids else len(g.ids)
        assert c.ids == g.ids[:cut] and c.stopped == (stop in g.ids)


def test_top_k_1_and_a_tiny_top_p_are_greedy(model):
    greedy = [c.ids for c in LocalSampler(model).generate(PROMPTS, [0] * 4, SamplingParams(8, temperature=0))]
    for params in (SamplingParams(8, temperature=1.5, top_k=1), SamplingParams(8, temperature=1.5, top_p=1e-6)):
        assert [c.ids for c in LocalSampler(model).generate(PROMPTS, [5, 6, 7, 8], params)] == greedy


def test_top_p_samples_only_within_the_nucleus(model):
    """With top_p 0.5 every drawn token is among the most likely tokens whose probability
    (before it) is under 0.5, recomputed from an uncached forward."""
    params = SamplingParams(6, temperature=1.0, top_p=0.5)
    for prompt, completion in zip(PROMPTS, LocalSampler(model).generate(PROMPTS, [1, 2, 3, 4], params)):
        ids = list(prompt)
        for token in completion.ids:
            with torch.no_grad():
                probs = torch.softmax(model(torch.tensor([ids]))[0, -1], dim=-1)
            ordered = probs.sort(descending=True)
            above = ordered.values.cumsum(0) - ordered.values
            nucleus = set(ordered.indices[above < 0.5].tolist())
            assert token in nucleus
            ids.append(token)


def test_a_prompt_too_long_for_max_new_tokens_is_one_error(model):
    with pytest.raises(TrainbookError, match=r"prompt 1 has 30 tokens: with max_new_tokens=4 it needs 34 positions"):
        LocalSampler(model).generate([[1, 2], [1] * 30], [0, 0], SamplingParams(4))
