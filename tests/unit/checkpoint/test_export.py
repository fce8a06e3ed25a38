"""`trainbook export`: real DCP checkpoints in, real safetensors / Hugging Face folders out, and
the weights loaded back (into trainbook, and into transformers) give the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from trainbook.checkpoint import Checkpointer
from trainbook.commands.export import export, export_command
from trainbook.config import Config, ModelConfig, dump_toml
from trainbook.data.tokenizer import train_bpe
from trainbook.errors import TrainbookError
from trainbook.model import Llama, build_model, resolve

# GQA (4 query heads share 2 kv heads) and a non-default RoPE base, so a wrong head layout or
# a dropped rope_theta in config.json shows up in the logits.
GQA = dict(name="debug", n_heads=4, n_kv_heads=2, rope_theta=500000.0)
TEXT = "Who's there? Nay, answer me: stand, and unfold yourself. Long live the king!\n" * 20


def make_run(
    root: Path, *, tie: bool, step: int = 3, tokenizer: bool = False, edit=None
) -> tuple[Path, Llama]:
    """A run folder as training leaves it: config.resolved.toml, a committed checkpoints/step-N
    (a trainer entry beside the model, as the optimizer's would be), optionally tokenizer/."""
    cfg = Config(model=resolve(ModelConfig(**GQA, tie_embeddings=tie)))
    model = build_model(cfg.model, "cpu", seed=0)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    run_dir = root / "run"
    checkpointer = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)  # the trainer's own writer
    checkpointer.save(step, {"model": model.state_dict(), "trainer": {"step": torch.tensor(step)}})
    checkpointer.close()
    (run_dir / "config.resolved.toml").write_text(dump_toml(cfg))
    if tokenizer:
        train_bpe([TEXT], vocab_size=300).save(run_dir / "tokenizer")
    return run_dir, model


def tokens(batch: int = 2, seq_len: int = 24, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_safetensors_round_trip_gives_bitwise_identical_logits(tmp_path, tie):
    run_dir, model = make_run(tmp_path, tie=tie)
    out = export(run_dir, "safetensors", tmp_path / "out", "fp32")  # the run: its latest checkpoint
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert not (tmp_path / "out.tmp").exists()

    with safe_open(out / "model.safetensors", "pt") as f:
        meta, names = f.metadata(), set(f.keys())
    assert meta["trainbook.step"] == "3" and meta["trainbook.layout"] == "trainbook"
    assert ModelConfig(**json.loads(meta["trainbook.model"])) == model.cfg
    assert ("output.weight" in names) is not tie, "a tied matrix is written once"

    fresh = build_model(model.cfg, "cpu", seed=1)  # different weights until loaded
    load_model(fresh, out / "model.safetensors")  # strict; re-points the tied head at the embedding
    if tie:
        assert fresh.output.weight is fresh.tok_embeddings.weight
    x = tokens()
    assert torch.equal(logits(fresh, x), logits(model, x))


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_export_rounds_each_weight_like_to(tmp_path, dtype, torch_dtype):
    run_dir, model = make_run(tmp_path, tie=False)
    out = export(run_dir / "checkpoints" / "step-3", "safetensors", tmp_path / "out", dtype)
    weights = load_file(out / "model.safetensors")
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    for name, t in weights.items():
        assert t.dtype == torch_dtype, name
        assert torch.equal(t, expected[name].to(torch_dtype)), name


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_export_loads_in_transformers_with_matching_logits(tmp_path, tie):
    import transformers
    run_dir, model = make_run(tmp_path, tie=tie, tokenizer=True)
    out = export(run_dir, "hf", tmp_path / "hf", "fp32")

    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["rope_theta"] == 500000.0
    assert config["tie_word_embeddings"] is tie and config["eos_token_id"] == 0  # train_bpe: EOS is 0
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float32
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) is tie
    x = tokens()
    with torch.no_grad():
        theirs = hf(x).logits
    torch.testing.assert_close(theirs, logits(model, x), rtol=0, atol=1e-5)


def test_hf_export_carries_the_runs_tokenizer(tmp_path):
    import transformers
    run_dir, _ = make_run(tmp_path, tie=True, tokenizer=True)
    out = export(run_dir, "hf", tmp_path / "hf", "bf16")
    saved = set((run_dir / "tokenizer").iterdir())
    assert {p.name for p in saved} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

    from trainbook.data import Tokenizer

    ours = Tokenizer.load(run_dir / "tokenizer")
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "Stand, and unfold yourself! Who's there?"
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == ours.eos_id


def _tokenizer_with(post: str, add_bos: bool):
    """A trained BPE whose tokenizer.json has post-processor `post` ("none", "bos": a template
    adding BOS, "bytelevel": one adding no token), loaded as a recipe's `hf` tokenizer."""
    from tokenizers import processors

    from trainbook.data.tokenizer import HFTokenizer

    hf = train_bpe([TEXT], vocab_size=300, bos_token="<s>")._hf
    hf.post_processor = {
        "none": None, "bytelevel": processors.ByteLevel(trim_offsets=False),
        "bos": processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]),
    }[post]  # fmt: skip
    files = {"tokenizer.json": hf.to_str().encode()}
    return HFTokenizer(files, kind="hf", bos_token="<s>", add_bos=add_bos)


@pytest.mark.parametrize("post, add_bos, rewritten", [
    ("bos", False, True), ("none", True, True), ("bytelevel", True, True), ("bos", True, False),
])  # fmt: skip
def test_hf_export_adds_bos_exactly_when_the_run_does(tmp_path, post, add_bos, rewritten):
    transformers = pytest.importorskip("transformers")
    run_dir, _ = make_run(tmp_path, tie=True)
    ours = _tokenizer_with(post, add_bos)
    ours.save(run_dir / "tokenizer")
    out = export(run_dir, "hf", tmp_path / "hf", "fp32")
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in ("Stand, and unfold yourself!", ""):
        assert theirs(text)["input_ids"] == ours.encode(text)
    assert ours.encode("x")[:1] == [1] if add_bos else 1 not in ours.encode("x")
    same = (out / "tokenizer.json").read_bytes() == ours.files["tokenizer.json"]
    assert same is not rewritten
    # The meta file names tokenizer.json by its sha256: kept only while that still holds.
    assert (out / "tokenizer_meta.json").is_file() is not rewritten


def test_a_weight_that_overflows_fp16_is_named(tmp_path):
    run_dir, _ = make_run(tmp_path, tie=False, edit=lambda m: m.norm.weight.fill_(70000.0))
    with pytest.raises(TrainbookError, match=r"'model.norm.weight' overflows fp16"):
        export(run_dir, "safetensors", tmp_path / "out", "fp16")
    assert export(run_dir, "safetensors", tmp_path / "out", "bf16").is_dir()  # bf16 has fp32's range


def test_refuses_a_non_empty_out_and_leaves_it_alone(tmp_path):
    run_dir, _ = make_run(tmp_path, tie=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(TrainbookError, match="--out") as e:
        export(run_dir, "safetensors", out, "fp32")
    assert len(str(e.value).splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()  # an empty folder is fine
    assert export(run_dir, "safetensors", out, "fp32") == out


def test_a_stale_tmp_from_a_crashed_export_is_replaced(tmp_path):
    run_dir, _ = make_run(tmp_path, tie=False)
    (tmp_path / "out.tmp").mkdir()
    (tmp_path / "out.tmp" / "model.safetensors").write_bytes(b"half written")
    out = export(run_dir, "safetensors", tmp_path / "out", "fp32")
    assert load_file(out / "model.safetensors").keys() and not (tmp_path / "out.tmp").exists()


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainbookError, match="neither a run directory nor a checkpoint"):
        export(tmp_path / "empty", "hf", tmp_path / "out", "fp32")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt, dtype, flag", [("gguf", "fp32", "--format"), ("hf", "fp8", "--dtype")])
def test_unknown_format_or_dtype(tmp_path, fmt, dtype, flag):
    run_dir, _ = make_run(tmp_path, tie=False)
    with pytest.raises(TrainbookError, match=flag):
        export(run_dir, fmt, tmp_path / "out", dtype)


def test_a_checkpoint_of_another_shape_is_named(tmp_path):
    run_dir, _ = make_run(tmp_path, tie=False)
    cfg = Config(model=resolve(ModelConfig(**GQA, tie_embeddings=False, ffn_dim=96)))
    (run_dir / "config.resolved.toml").write_text(dump_toml(cfg))
    named = r"'model.layers.0.feed_forward.w1.weight' has shape \[128, 64\] in the checkpoint, \[96, 64\]"
    with pytest.raises(TrainbookError, match=named):
        export(run_dir, "hf", tmp_path / "out", "fp32")


def test_export_command_line(tmp_path):
    run_dir, _ = make_run(tmp_path, tie=True)
    line = export_command(run_dir, "hf", tmp_path / "hf", "bf16")
    assert line.startswith("exported hf (bf16, ") and line.endswith(str(tmp_path / "hf"))
    assert "\n" not in line
