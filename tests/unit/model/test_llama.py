"""The Llama model: shapes, causality, GQA and RoPE against references, init, builds, counts."""

import math

import pytest
import torch

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model import Llama, build_model, flops_per_token, names, num_params, resolve
from trainbook.model.llama import apply_rope, rope_tables

DEBUG = ModelConfig(name="debug")


@pytest.fixture(scope="module")
def debug_model():
    return build_model(DEBUG, "cpu", seed=0)


def tokens(batch, seq_len, vocab=512, seed=0):
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def test_logits_shape_and_dtype(debug_model):
    logits = debug_model(tokens(3, 17))
    assert logits.shape == (3, 17, 512) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_module_paths_follow_the_convention(debug_model):
    # parallel/ keys its plans by these paths; pipeline stages drop entries of `layers`.
    paths = dict(debug_model.named_modules())
    assert isinstance(debug_model.layers, torch.nn.ModuleDict)
    assert list(debug_model.layers) == ["0", "1"]
    for p in ["tok_embeddings", "norm", "output"]:
        assert p in paths
    for i in ["0", "1"]:
        for sub in ["attention.wq", "attention.wk", "attention.wv", "attention.wo",
                    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                    "attention_norm", "ffn_norm"]:
            assert f"layers.{i}.{sub}" in paths
    assert all("bias" not in name for name, _ in debug_model.named_parameters())
    assert "rope_cos" not in debug_model.state_dict(), "RoPE tables are derived, not checkpointed"


def test_causal_changing_a_token_affects_only_later_positions(debug_model):
    x = tokens(2, 32)
    t = 11
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % 512
    a, b = debug_model(x), debug_model(y)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    diff = (a[:, t:] - b[:, t:]).abs().amax(dim=-1)  # (B, T - t)
    assert (diff > 1e-4).all(), "every position >= t sees the changed token"


def reference_attention(attn, x, cos, sin):
    """Grouped-query attention written out: repeated kv heads, explicit mask and softmax."""
    bsz, seq_len, _ = x.shape
    hd = attn.head_dim
    q = apply_rope(attn.wq(x).view(bsz, seq_len, -1, hd), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(bsz, seq_len, -1, hd), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(bsz, seq_len, -1, hd).transpose(1, 2)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # (B, H, T, T)
    future = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(bsz, seq_len, -1)
    return attn.wo(out)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_matches_explicit_reference(n_kv_heads):
    model = build_model(ModelConfig(name="debug", n_kv_heads=n_kv_heads), "cpu", seed=3)
    attn = model.layers["0"].attention
    assert attn.wk.weight.shape == (n_kv_heads * attn.head_dim, 64)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope_cos[:24], model.rope_sin[:24]
    with torch.no_grad():
        got, want = attn(x, cos, sin), reference_attention(attn, x, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_rope_scores_depend_only_on_relative_position():
    cfg = resolve(ModelConfig(name="debug", rope_theta=500000.0))
    cos, sin = rope_tables(cfg)
    hd = cfg.dim // cfg.n_heads
    gen = torch.Generator().manual_seed(0)
    # The same query and key vector at every position: any change of score with position comes
    # from RoPE alone.
    q = torch.randn(hd, generator=gen).expand(1, 64, 1, hd)
    k = torch.randn(hd, generator=gen).expand(1, 64, 1, hd)
    qr, kr = apply_rope(q, cos[:64], sin[:64])[0, :, 0], apply_rope(k, cos[:64], sin[:64])[0, :, 0]
    scores = qr @ kr.T  # (T, T): scores[i, j] = <q at i, k at j>
    for shift in [1, 7, 30]:
        shifted, original = scores[shift:, shift:], scores[:-shift, :-shift]
        torch.testing.assert_close(shifted, original, atol=1e-4, rtol=0)
    # ...and RoPE is not a no-op: the score does change with the distance.
    assert (scores[10, 0] - scores[10, 10]).abs() > 1e-3
    # A rotation keeps the norm of every vector.
    torch.testing.assert_close(qr.norm(dim=-1), q[0, :, 0].norm(dim=-1))


def test_rope_tables_are_fp32_buffers_outside_the_state_dict(debug_model):
    assert debug_model.rope_cos.dtype == torch.float32
    assert debug_model.rope_cos.shape == (256, 8)  # (max_seq_len, head_dim / 2)
    cos, sin = rope_tables(debug_model.cfg)
    assert torch.equal(debug_model.rope_cos, cos) and torch.equal(debug_model.rope_sin, sin)


def test_tied_and_untied_parameter_counts():
    untied = build_model(ModelConfig(name="debug", tie_embeddings=False), "cpu", seed=0)
    tied = build_model(ModelConfig(name="debug", tie_embeddings=True), "cpu", seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight  # survives to_empty from meta
    assert num_params(untied) - num_params(tied) == 512 * 64
    # Analytic: per block wq, wo (64x64), wk, wv (64x32), 3 ffn matrices (64x128), 2 norms.
    per_block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert num_params(untied) == 2 * 512 * 64 + 2 * per_block + 64
    assert num_params(untied, exclude_embeddings=True) == num_params(untied) - 512 * 64
    assert num_params(tied, exclude_embeddings=True) == 2 * per_block + 64


def test_tied_gradients_accumulate_in_one_tensor():
    model = build_model(ModelConfig(name="debug", tie_embeddings=True), "cpu", seed=0)
    model(tokens(1, 8)).sum().backward()
    assert model.output.weight.grad is model.tok_embeddings.weight.grad


def test_same_seed_bitwise_identical_different_seed_not():
    a, b = build_model(DEBUG, "cpu", seed=7), build_model(DEBUG, "cpu", seed=7)
    c = build_model(DEBUG, "cpu", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a.rope_cos, b.rope_cos)
    matrices = [k for k in sa if sa[k].dim() == 2]
    assert all(not torch.equal(sa[k], sc[k]) for k in matrices)


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    build_model(DEBUG, "cpu", seed=0)
    assert torch.equal(torch.get_rng_state(), before)


def test_init_statistics():
    model = build_model(ModelConfig(name="tiny"), "cpu", seed=0)
    std, n_layers = 0.02, 4
    out_std = std / math.sqrt(2 * n_layers)
    block = model.layers["0"]
    for w, want in [(model.tok_embeddings.weight, std), (block.attention.wq.weight, std),
                    (block.feed_forward.w1.weight, std), (block.attention.wo.weight, out_std),
                    (block.feed_forward.w2.weight, out_std)]:
        assert w.mean().abs() < 0.1 * want
        assert abs(w.std().item() / want - 1) < 0.05
    assert torch.equal(block.attention_norm.weight, torch.ones(192))
    assert torch.equal(model.norm.weight, torch.ones(192))


def test_direct_construction_is_usable_and_deterministic_given_the_global_rng():
    torch.manual_seed(5)
    a = Llama(resolve(DEBUG))
    torch.manual_seed(5)
    b = Llama(resolve(DEBUG))
    x = tokens(1, 8)
    assert torch.equal(a(x), b(x))


def test_too_long_sequence_is_a_user_error(debug_model):
    with pytest.raises(TrainbookError) as err:
        debug_model(tokens(1, 257))
    assert err.value.where == "model.max_seq_len"


def test_a_pipeline_stage_can_drop_blocks_and_ends():
    model = build_model(DEBUG, "cpu", seed=0)
    x = tokens(2, 8)
    full = model(x)
    # Stage 0: embedding + block 0; stage 1: block 1 + norm + head. Chained, they equal the model.
    first, last = build_model(DEBUG, "cpu", seed=0), build_model(DEBUG, "cpu", seed=0)
    del first.layers["1"]
    first.norm, first.output = None, None
    del last.layers["0"]
    last.tok_embeddings = None
    hidden = first(x)
    assert hidden.shape == (2, 8, 64)
    torch.testing.assert_close(last(hidden), full, atol=0, rtol=0)


def test_bf16_autocast_forward_backward(debug_model):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = debug_model(tokens(2, 16))
    assert logits.dtype == torch.bfloat16
    logits.float().sum().backward()
    assert all(p.grad is not None for p in debug_model.parameters())
    debug_model.zero_grad(set_to_none=True)


# Published totals: Llama 3.1 model cards / "The Llama 3 Herd of Models"; Llama 3.2 model card.
PUBLISHED = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "llama3.2-1b": 1.24e9,
    "llama3.2-3b": 3.21e9,
}


@pytest.mark.parametrize("name", names())
def test_every_registry_entry_builds_on_meta(name):
    model = build_model(ModelConfig(name=name), "meta", seed=0)
    assert all(p.is_meta for p in model.parameters())
    assert len(model.layers) == model.cfg.n_layers
    if name in PUBLISHED:
        assert num_params(model) == pytest.approx(PUBLISHED[name], rel=0.01)


def test_flops_per_token():
    cfg = resolve(ModelConfig(name="llama3-8b"))
    n = num_params(build_model(cfg, "meta", seed=0))
    # Matmul weights = all parameters minus the embedding lookup and the norm gains.
    matmul = n - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    assert flops_per_token(cfg, 8192) == 6 * matmul + 12 * 32 * 4096 * 8192
    # A tied head still costs its matmul; resolving happens inside.
    assert flops_per_token(ModelConfig(name="tiny"), 256) == flops_per_token(
        ModelConfig(name="tiny", tie_embeddings=False), 256
    )
