"""The registry of named sizes and `resolve`: complete entries, overrides, shape errors."""

import pytest

from trainbook.config.model import ModelConfig
from trainbook.errors import TrainbookError
from trainbook.model import names, resolve
from trainbook.model.families import FAMILIES
from trainbook.model.registry import MOE_DEFAULTS, MOE_FIELDS, OPTIONS, REGISTRY, is_resolved, source

ARCH_FIELDS = [f for f in ModelConfig.model_fields if f not in ("name", "init_from", "resize_init")]


def test_names_list_every_entry():
    assert names() == list(REGISTRY)
    for required in ["tiny", "debug", "llama3-8b", "llama3-70b", "llama3-405b", "llama3.2-1b",
                     "llama3.2-3b"]:
        assert required in names()


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_entry_is_complete_cited_and_valid(name):
    entry = REGISTRY[name]
    required = {"source", "family", *(k for k in ARCH_FIELDS if k not in OPTIONS + MOE_FIELDS)}
    if "n_experts" in entry:  # a mixture of experts: the MoE fields but those with defaults
        required |= {k for k in MOE_FIELDS if k not in MOE_DEFAULTS}
    assert required <= set(entry) <= {"source", *ARCH_FIELDS}, "every field but the family's options, nothing else"
    assert source(name)
    cfg = resolve(ModelConfig(name=name))
    assert is_resolved(cfg)
    assert all(getattr(cfg, k) == entry[k] for k in entry if k != "source")
    fam = FAMILIES[entry["family"]]  # what the entry leaves out, its family decides
    assert (cfg.qkv_bias, cfg.qk_norm) == (fam.qkv_bias, fam.qk_norm)
    assert cfg.head_dim == entry.get("head_dim", cfg.dim // cfg.n_heads)


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
