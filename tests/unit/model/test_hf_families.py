"""Every family against transformers' own class (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`), built offline on a tiny config that is nobody's default: head_dim 24 where
hidden_size / num_attention_heads is 16 (so q is 96 wide against a 64-wide residual), GQA (4 query
heads share 2 kv heads), RoPE base 1e6, tied and untied. Every tensor is random before it is saved,
biases and norm gains included (transformers starts them at 0 and 1, where a swapped or dropped
name would not show). Then: import's logits against transformers'; export loaded back by
transformers; import -> export -> import bit for bit; the config.json refusals; Qwen's real
tokenizer.json."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.conftest import qwen_tokenizer_files
from tests.unit.model.test_hf_import import one_line_error
from trainbook.checkpoint import Checkpointer
from trainbook.commands.export import export
from trainbook.config import Config, ModelConfig, TokenizerConfig, dump_toml
from trainbook.data.tokenizer import build_tokenizer, hf_tokenizer_config
from trainbook.model import build_model
from trainbook.model.hf_import import load_hf_weights, model_config_from_hf

CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, rope_theta=1e6, max_position_embeddings=64,
             rms_norm_eps=1e-6)  # fmt: skip
# The options each family's decoder gets from the config.json alone.
OPTIONS = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}  # (qkv_bias, qk_norm)
CASES = pytest.mark.parametrize("fam, tie", [(f, t) for f in CLASSES for t in (False, True)],
                                ids=[f"{f}-{'tied' if t else 'untied'}" for f in CLASSES for t in (False, True)])  # fmt: skip
# Import's logits differ from transformers' by this much at most (fp32, |logits| up to ~4); the
# whole difference is the RoPE table (test_imported_logits_match_transformers).
ATOL = 1e-5


def save_hf(root: Path, fam: str, tie: bool, **changes) -> tuple[Path, torch.nn.Module]:
    """A random tiny model of `fam` saved by transformers into root/hf; returns (dir, model)."""
    config_cls, model_cls = CLASSES[fam]
    torch.manual_seed(0)
    return save_random(root, model_cls(config_cls(**SHAPE | changes, tie_word_embeddings=tie)))


def save_random(root: Path, hf: torch.nn.Module) -> tuple[Path, torch.nn.Module]:
    """`hf` with every tensor random (norm gains near 1), saved by transformers into root/hf."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    out = root / "hf"
    hf.eval().save_pretrained(out)
    return out, hf


def import_hf(path: Path):
    model = build_model(model_config_from_hf(path), "cpu", seed=0)
    load_hf_weights(model, path)
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def logits(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


# ---- parity --------------------------------------------------------------------------------------


@CASES
def test_imported_logits_match_transformers(tmp_path, fam, tie):
    path, hf = save_hf(tmp_path, fam, tie)
    files = load_file(path / "model.safetensors")
    # The family's own tensors are there, and none is left at its init value.
    assert any(k.endswith("q_proj.bias") for k in files) is (fam == "qwen2")
    assert any(k.endswith("q_norm.weight") for k in files) is (fam == "qwen3")
    assert all(t.std() > 0.05 for t in files.values())
    cfg = model_config_from_hf(path)
    assert (cfg.family, (cfg.qkv_bias, cfg.qk_norm), cfg.head_dim, cfg.n_kv_heads) == (fam, OPTIONS[fam], 24, 2)
    assert (cfg.rope_theta, cfg.tie_embeddings) == (1e6, tie)
    model, x = import_hf(path), tokens()
    theirs = logits(hf, x)
    torch.testing.assert_close(logits(model, x), theirs, rtol=0, atol=ATOL)
    # Not bit for bit, and only because of RoPE's inverse frequencies: trainbook computes
    # theta ** -(2i / d), transformers 1 / theta ** (2i / d), which differ in the last bit for some
    # i. With transformers' own cos/sin tables in the model's buffers the logits are bitwise equal,
    # so every other op (norms, q/k norms, biases, GQA attention, SwiGLU, the tied head) is.
    positions = torch.arange(cfg.max_seq_len)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)  # (1, T, head_dim)
    assert not torch.equal(model.rope_cos, cos[0, :, : cfg.head_dim // 2])
    model.rope_cos.copy_(cos[0, :, : cfg.head_dim // 2])
    model.rope_sin.copy_(sin[0, :, : cfg.head_dim // 2])
    assert torch.equal(logits(model, x), theirs)


def export_run(tmp_path: Path, cfg: ModelConfig, state: dict) -> Path:
    """`trainbook export --format hf` of a run directory as training leaves it, holding `state`."""
    run_dir = tmp_path / "run"
    checkpointer = Checkpointer(run_dir / "checkpoints", Config(model=cfg).checkpoint)
    checkpointer.save(1, {"model": state, "trainer": {"step": torch.tensor(1)}})
    checkpointer.close()
    (run_dir / "config.resolved.toml").write_text(dump_toml(Config(model=cfg)))
    return export(run_dir, "hf", tmp_path / "exported", "fp32")


def assert_round_trip(path: Path, out: Path, model, hf, cls: type) -> None:
    """The export `out` of the model imported from `path` holds the folder's tensors bit for bit (a
    tied head written by neither), transformers loads it as `cls` with no missing, unexpected or
    mismatched key and computes `hf`'s logits, and importing it again gives the model back."""
    original, exported = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(back) is cls
    assert {k: v for k, v in info.items() if v} == {}
    x = tokens()
    assert torch.equal(logits(back.eval(), x), logits(hf, x))
    again = import_hf(out)
    assert again.cfg == model.cfg
    ours, theirs = model.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@CASES
def test_export_loads_into_transformers_and_reimports_bit_for_bit(tmp_path, fam, tie):
    path, hf = save_hf(tmp_path, fam, tie)
    model = import_hf(path)
    out = export_run(tmp_path, model.cfg, model.state_dict())
    assert_round_trip(path, out, model, hf, CLASSES[fam][1])


@pytest.mark.parametrize("fam, option", [("llama", "qkv_bias"), ("qwen2", "qkv_bias"), ("qwen3", "qk_norm")])
def test_export_refuses_an_option_the_familys_class_cannot_express(tmp_path, fam, option):
    cfg = model_config_from_hf(save_hf(tmp_path, fam, tie=False)[0])
    cfg = cfg.model_copy(update={option: not getattr(cfg, option)})  # e.g. a Llama with q/k/v biases
    state = build_model(cfg, "cpu", seed=0).state_dict()
    arch = CLASSES[fam][1].__name__
    message = (f"{arch} has qkv_bias={str(OPTIONS[fam][0]).lower()}, qk_norm={str(OPTIONS[fam][1]).lower()}; "
               f"this model has qkv_bias={str(cfg.qkv_bias).lower()}, qk_norm={str(cfg.qk_norm).lower()}, "
               "which no Hugging Face class of its family computes")  # fmt: skip
    one_line_error(export_run, tmp_path, cfg, state, match=message, where="model.family")
    assert not (tmp_path / "exported").exists() and not (tmp_path / "exported.tmp").exists()


# ---- config.json ---------------------------------------------------------------------------------


def write_config(path: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in drop} | changes
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One untied model of each family, config.json and weights as transformers wrote them."""
    return {fam: save_hf(tmp_path_factory.mktemp(fam), fam, tie=False)[0] for fam in CLASSES}


@pytest.fixture
def config_dir(saved, tmp_path):
    def copy(fam: str) -> Path:
        shutil.copytree(saved[fam], tmp_path / fam)
        return tmp_path / fam

    return copy


@pytest.mark.parametrize("fam, changes, named", [
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window=true"),
    ("qwen3", dict(use_sliding_window=True), "use_sliding_window=true"),
    ("qwen3", dict(attention_bias=True), "attention_bias=true \\(a bias on o_proj too"),
    ("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "RoPE scaling 'yarn'"),
    ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}), "RoPE scaling 'dynamic'"),
    # transformers 4.x's key; transformers 5 takes it over rope_parameters
    ("qwen3", dict(rope_scaling={"type": "linear", "factor": 2.0}), "RoPE scaling 'linear'"),
])  # fmt: skip
def test_what_trainbook_would_compute_differently_is_refused_in_one_line(config_dir, fam, changes, named):
    path = write_config(config_dir(fam), **changes)
    one_line_error(model_config_from_hf, path, match=f"unsupported: {named}", where=path / "config.json")


def test_keys_a_qwen_class_ignores_are_not_refused(saved, config_dir):
    """Qwen2 hard-wires q/k/v biases and no o_proj bias whatever attention_bias says; neither Qwen
    has an MLP bias; use_sliding_window false makes transformers drop sliding_window."""
    for fam, changes in (("qwen2", dict(attention_bias=True, mlp_bias=True, sliding_window=4096)),
                         ("qwen3", dict(mlp_bias=True, sliding_window=4096))):  # fmt: skip
        path = write_config(config_dir(fam), **changes)
        assert model_config_from_hf(path) == model_config_from_hf(saved[fam])
        config_cls, model_cls = CLASSES[fam]
        with torch.device("meta"):
            layer = model_cls(config_cls.from_pretrained(path)).model.layers[0]
        assert layer.self_attn.o_proj.bias is None and layer.mlp.gate_proj.bias is None
        assert config_cls.from_pretrained(path).layer_types == ["full_attention"] * 2


@pytest.mark.parametrize("fam", list(CLASSES))
def test_rope_theta_is_read_from_either_spelling(config_dir, fam):
    path = config_dir(fam)
    assert "rope_parameters" in json.loads((path / "config.json").read_text())  # transformers 5 wrote it
    assert model_config_from_hf(path).rope_theta == 1e6
    # transformers 4.x's flat key (what export writes), and 5's table, each alone
    write_config(path, drop=("rope_parameters",), rope_theta=5e5, rope_scaling=None)
    assert model_config_from_hf(path).rope_theta == 5e5 == CLASSES[fam][0].from_pretrained(path).rope_parameters["rope_theta"]
    write_config(path, drop=("rope_theta", "rope_scaling"), rope_parameters={"rope_type": "default", "rope_theta": 2e5})
    assert model_config_from_hf(path).rope_theta == 2e5 == CLASSES[fam][0].from_pretrained(path).rope_parameters["rope_theta"]
    # both: the table wins, as in transformers 5; neither: transformers' default
    write_config(path, rope_theta=5e5)
    assert model_config_from_hf(path).rope_theta == 2e5 == CLASSES[fam][0].from_pretrained(path).rope_parameters["rope_theta"]
    # a 4.x rope_scaling table, when set, replaces rope_parameters in transformers 5
    write_config(path, rope_scaling={"rope_type": "default", "rope_theta": 3e5})
    assert model_config_from_hf(path).rope_theta == 3e5 == CLASSES[fam][0].from_pretrained(path).rope_parameters["rope_theta"]
    write_config(path, drop=("rope_theta", "rope_parameters", "rope_scaling"))
    assert model_config_from_hf(path).rope_theta == 1e4 == CLASSES[fam][0].from_pretrained(path).rope_parameters["rope_theta"]


@pytest.mark.parametrize("fam, head_dim", [("llama", 16), ("qwen2", 16), ("qwen3", 128)])
def test_left_out_keys_get_transformers_defaults(config_dir, fam, head_dim):
    """head_dim: Qwen3Config's default is 128 at every size, the others hidden_size / heads.
    num_key_value_heads: Qwen2Config and Qwen3Config default to 32, LlamaConfig to the query heads;
    an explicit null is the query heads in all three."""
    path = write_config(config_dir(fam), drop=("head_dim",))
    config_cls = CLASSES[fam][0]
    theirs = config_cls.from_pretrained(path)
    assert model_config_from_hf(path).head_dim == head_dim == (getattr(theirs, "head_dim", None) or 64 // 4)

    write_config(path, num_key_value_heads=None)
    assert model_config_from_hf(path).n_kv_heads == 4 == config_cls.from_pretrained(path).num_key_value_heads
    write_config(path, drop=("num_key_value_heads",))
    assert config_cls.from_pretrained(path).num_key_value_heads == (4 if fam == "llama" else 32)
    if fam == "llama":
        assert model_config_from_hf(path).n_kv_heads == 4
    else:  # 4 query heads cannot share 32 kv heads: named, with where the 32 came from
        one_line_error(model_config_from_hf, path, match="num_attention_heads=4 is not a multiple of "
                       "num_key_value_heads=32 \\(its default", where=path / "config.json")  # fmt: skip
        write_config(path, num_attention_heads=32, hidden_size=256)
        assert model_config_from_hf(path).n_kv_heads == 32 == config_cls.from_pretrained(path).num_key_value_heads


# ---- Qwen's tokenizer ----------------------------------------------------------------------------

# Special ids of Qwen2.5's and Qwen3's tokenizer.json.
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
CHAT = "<|im_start|>user\nhi<|im_end|>"
TEXTS = ["Who's there?", " Nay, answer me:  stand,\tand unfold yourself.\n\nLong live the king!",
         "ünïcödé 日本語 🙂 e\u0301", "it's  we'll 123 4567 ...!!  \n\n\t x", ""]  # fmt: skip


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A Hugging Face directory holding Qwen3's tokenizer.json and nothing else."""
    path = tmp_path_factory.mktemp("qwen-tokenizer")
    shutil.copy(qwen_tokenizer_files() / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    settings = hf_tokenizer_config(qwen_dir)
    assert settings == {"kind": "hf", "path": str(qwen_dir / "tokenizer.json"), "add_bos": False}
    return build_tokenizer(TokenizerConfig(**settings), list)


def test_qwen_tokenizer_json_reads_with_its_own_special_ids(qwen):
    assert qwen.vocab_size == 151_669  # 151,643 merges' tokens and 26 added ones
    assert (qwen.token_to_id("<|endoftext|>"), qwen.token_to_id("<|im_start|>"), qwen.token_to_id("<|im_end|>")) == (
        ENDOFTEXT, IM_START, IM_END)
    # EOS is the special <|endoftext|>, not the ordinary BPE token "</s>" (id 128247) that comes
    # first in the candidates; likewise no BOS from the ordinary "<s>" (128245).
    assert (qwen.eos_token, qwen.eos_id) == ("<|endoftext|>", ENDOFTEXT)
    assert qwen.token_to_id("</s>") == 128247 and qwen.bos_id is None and qwen.pad_id is None


def test_qwen_tokenizer_encodes_like_transformers(qwen, qwen_dir):
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"))
    assert qwen.encode_batch(TEXTS) == [theirs(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    # Text round-trips as its NFC form: Qwen's tokenizer normalises first (e + U+0301 -> é).
    assert [qwen.decode(ids) for ids in qwen.encode_batch(TEXTS)] == [unicodedata.normalize("NFC", t) for t in TEXTS]
    # A chat turn: transformers reads the markers as the special tokens; trainbook's ids for the
    # same turn are the markers' ids around the encoded text, and decode back to the turn.
    assert theirs(CHAT, add_special_tokens=False)["input_ids"] == [IM_START, 872, 198, 6023, IM_END]
    turn = [qwen.token_to_id("<|im_start|>"), *qwen.encode("user\nhi"), qwen.token_to_id("<|im_end|>")]
    assert turn == [IM_START, 872, 198, 6023, IM_END] and qwen.decode(turn) == CHAT
    # A marker's text inside a document stays text (every kind: only packing places specials).
    literal = qwen.encode(CHAT)
    assert not {ENDOFTEXT, IM_START, IM_END} & set(literal) and qwen.decode(literal) == CHAT


def test_qwen_directory_with_its_tokenizer_config_names_its_specials(qwen_dir, tmp_path):
    """Qwen3's tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>, no BOS) and a config.json
    whose bos_token_id is 151643, as Qwen3-0.6B's is."""
    shutil.copy(qwen_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(qwen_tokenizer_files() / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": ENDOFTEXT, "eos_token_id": IM_END}))
    settings = hf_tokenizer_config(tmp_path)
    assert settings == {"kind": "hf", "path": str(tmp_path / "tokenizer.json"), "eos_token": "<|im_end|>",
                        "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "add_bos": False}  # fmt: skip
    tok = build_tokenizer(TokenizerConfig(**settings), list)
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (IM_END, ENDOFTEXT, ENDOFTEXT)
