"""The registry of named sizes and `resolve`: complete entries, overrides, shape errors."""

import pytest

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model import names, resolve
from trainbook.model.families import FAMILIES
from trainbook.model.registry import MLA_FIELDS, MOE_DEFAULTS, MOE_FIELDS, OPTIONS, REGISTRY, is_resolved, source

ARCH_FIELDS = [f for f in ModelConfig.model_fields if f not in ("name", "init_from", "resize_init")]


def test_names_list_every_entry():
    assert names() == list(REGISTRY)
    for required in ["tiny", "debug", "llama3-8b", "llama3-70b", "llama3-405b", "llama3.2-1b",
                     "llama3.2-3b"]:
        assert required in names()


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_entry_is_complete_cited_and_valid(name):
    entry = REGISTRY[name]
    required = {"source", "family", *(k for k in ARCH_FIELDS if k not in OPTIONS + MOE_FIELDS + MLA_FIELDS)}
    if "n_experts" in entry:  # a mixture of experts: the MoE fields but those with defaults
        required |= {k for k in MOE_FIELDS if k not in MOE_DEFAULTS}
    if "kv_lora_rank" in entry:  # multi-head latent attention: every one of its fields
        required |= set(MLA_FIELDS)
    assert required <= set(entry) <= {"source", *ARCH_FIELDS}, "every field but the family's options, nothing else"
    assert source(name)
    cfg = resolve(ModelConfig(name=name))
    assert is_resolved(cfg)
    assert all(getattr(cfg, k) == entry[k] for k in entry if k != "source")
    fam = FAMILIES[entry["family"]]  # what the entry leaves out, its family decides
    assert (cfg.qkv_bias, cfg.qk_norm) == (fam.qkv_bias, fam.qk_norm)
    assert cfg.head_dim == entry.get("head_dim", entry.get("qk_rope_head_dim", cfg.dim // cfg.n_heads))


def test_tiny_shape():
    cfg = resolve(ModelConfig(name="tiny"))
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (
        192, 4, 6, 2, 512, 2048
    )
    assert cfg.tie_embeddings and cfg.rope_theta == 10000 and cfg.max_seq_len == 1024


def test_overrides_win_and_resolve_is_idempotent():
    cfg = resolve(ModelConfig(name="tiny", n_layers=2, vocab_size=300, tie_embeddings=False))
    assert (cfg.n_layers, cfg.vocab_size, cfg.tie_embeddings) == (2, 300, False)
    assert cfg.dim == 192  # not overridden: from the registry
    assert resolve(cfg) == cfg


def test_unknown_name_suggests_the_closest():
    with pytest.raises(TrainbookError) as err:
        resolve(ModelConfig(name="llama3-8B"))
    assert err.value.where == "model.name"
    assert "did you mean 'llama3-8b'" in str(err.value)


@pytest.mark.parametrize(
    "overrides, where",
    [
        (dict(dim=100), "model.dim"),  # 100 % 6 heads
        (dict(n_heads=5), "model.n_heads"),  # 192 % 5
        (dict(n_kv_heads=4), "model.n_kv_heads"),  # 6 % 4
        (dict(n_heads=4, n_kv_heads=3), "model.n_heads"),  # 4 % 3; both set: blame the first
        (dict(dim=198), "model.dim"),  # head_dim = 198 / 6 = 33, odd
        (dict(n_heads=64, n_kv_heads=2), "model.n_heads"),  # head_dim = 3, odd
    ],
)
def test_invalid_shapes_name_the_key(overrides, where):
    with pytest.raises(TrainbookError) as err:
        resolve(ModelConfig(name="tiny", **overrides))
    assert err.value.where == where
    assert str(err.value).startswith(where + ": ")


MLA = dict(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_kv_heads=6)


@pytest.mark.parametrize("overrides, where, message", [
    (dict(q_lora_rank=8), "model.q_lora_rank", "q_lora_rank is set but kv_lora_rank is not"),
    ({**MLA, "v_head_dim": None}, "model.v_head_dim", "multi-head latent attention \\(kv_lora_rank=16\\) needs v_head_dim"),
    ({**MLA, "qk_rope_head_dim": 7}, "model.qk_rope_head_dim", "qk_rope_head_dim=7 is odd"),
    ({**MLA, "head_dim": 16}, "model.head_dim", "head_dim=16 differs from qk_rope_head_dim=8"),
    ({**MLA, "n_kv_heads": 2}, "model.n_kv_heads", "n_kv_heads=2 differs from n_heads=6"),
    ({**MLA, "qk_norm": True}, "model.qk_norm", "qk_norm is an option of grouped-query attention"),
    ({**MLA, "v_head_dim": 24}, "model.v_head_dim", "v_head_dim=24 is wider than a query head"),
])  # fmt: skip
def test_latent_attention_fields_that_do_not_fit_name_the_key(overrides, where, message):
    """Multi-head latent attention on the tiny Llama: its fields all set or none, RoPE's width even
    and equal to head_dim, a key and value per query head, none of grouped-query attention's options."""
    given = {k: v for k, v in overrides.items() if v is not None}
    with pytest.raises(TrainbookError, match=message) as err:
        resolve(ModelConfig(name="tiny", **given))
    assert err.value.where == where


def test_latent_attention_resolves_head_dim_to_the_rotated_width():
    cfg = resolve(ModelConfig(name="tiny", **MLA))
    assert (cfg.head_dim, cfg.kv_lora_rank, cfg.q_lora_rank) == (8, 16, 0) and is_resolved(cfg)
    assert resolve(cfg) == cfg
