"""Document-aware attention: a packed window behaves like its documents run one by one."""

import pytest
import torch

from trainbook.config.model import ModelConfig
from trainbook.model import build_model
from trainbook.model.llama import document_mask


def positions_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])  # (T,)


# Multi-head latent attention on the debug shape: its own RoPE width, values narrower than keys.
MLA = dict(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_kv_heads=4)


@pytest.mark.parametrize("attention", [dict(n_kv_heads=1), dict(n_kv_heads=4), MLA], ids=["mqa", "mha", "mla"])
def test_packed_window_equals_each_document_run_alone(attention):
    model = build_model(ModelConfig(name="debug", **attention), "cpu", seed=0)
    gen = torch.Generator().manual_seed(0)
    layouts = [[5, 9, 7], [12, 9], [21]]  # 3 documents, 2, 1 in windows of 21 tokens
    tokens = torch.randint(0, 512, (len(layouts), 21), generator=gen)  # (B, T)
    positions = torch.stack([positions_of(lengths) for lengths in layouts])  # (B, T)
    with torch.no_grad():
        packed = model(tokens, positions)  # (B, T, V)
        for b, lengths in enumerate(layouts):
            start = 0
            for n in lengths:
                alone = model(tokens[b : b + 1, start : start + n])[0]  # (n, V)
                torch.testing.assert_close(packed[b, start : start + n], alone, atol=1e-5, rtol=0)
                start += n
        # One document spanning the window: the same as no positions at all.
        torch.testing.assert_close(packed[2], model(tokens[2:])[0], atol=1e-5, rtol=0)


def test_gradients_do_not_cross_document_boundaries():
    model = build_model(ModelConfig(name="debug"), "cpu", seed=1)
    h = model.tok_embeddings(torch.randint(0, 512, (1, 12))).detach().requires_grad_()
    positions = positions_of([4, 8])[None]  # (1, 12)
    model.tok_embeddings = None  # feed hidden states, to read their gradient
    model(h, positions)[0, :4].sum().backward()  # the first document's outputs only
    assert h.grad[0, 4:].abs().max() == 0 and h.grad[0, :4].abs().max() > 0


def test_document_mask_is_causal_and_block_diagonal():
    mask = document_mask(positions_of([2, 3])[None])  # (1, 1, 5, 5)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
