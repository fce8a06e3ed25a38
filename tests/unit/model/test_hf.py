"""The trainbook <-> Hugging Face Llama name table and config.json, against transformers itself."""

from __future__ import annotations

import pytest
import torch

from trainbook.config.model import ModelConfig
from trainbook.model import build_model, resolve
from trainbook.model.hf import from_hf_name, hf_config, to_hf_name, to_hf_state_dict


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_names_match_transformers_and_round_trip(tie):
    import transformers
    cfg = resolve(ModelConfig(name="debug", tie_embeddings=tie))
    ours = build_model(cfg, "meta", seed=0).state_dict()
    hf_names = to_hf_state_dict(ours, tied=tie).keys()

    with torch.device("meta"):
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(cfg, torch.float32)))
    # transformers' state dict names lm_head even when tied; its saved files do not.
    expected = {k for k in theirs.state_dict() if not (tie and k == "lm_head.weight")}
    assert set(hf_names) == expected
    for name, tensor in ours.items():
        assert from_hf_name(to_hf_name(name)) == name
        assert tuple(theirs.state_dict()[to_hf_name(name)].shape) == tuple(tensor.shape), name


def test_unknown_names_raise_key_error():
    with pytest.raises(KeyError):
        to_hf_name("layers.0.attention.rope")
    with pytest.raises(KeyError):
        from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_config_json_fields():
    cfg = resolve(ModelConfig(name="llama3-8b"))
    config = hf_config(cfg, torch.bfloat16, bos_id=128000, eos_id=128001)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "max_position_embeddings")
    assert tuple(config[k] for k in sizes) == (4096, 14336, 32, 128256, 8192)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
    assert config["rope_theta"] == 500000.0 and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (128000, 128001, None)
