"""The fine-tuning recipe end to end: a Hugging Face Llama directory (built offline here), a JSONL of
text, `trainbook run recipes/finetune-hf-llama.toml`, then export back to Hugging Face."""

import json

import torch
import transformers

from tests.conftest import PLAY, RECIPES, run_cli, run_cli_error, write_hf_llama


def test_finetune_recipe_trains_frozen_embedding_and_exports(tmp_path):
    write_hf_llama(tmp_path / "models" / "llama-hf")
    (tmp_path / "data").mkdir()
    lines = [json.dumps({"text": f"SCENE {i}.\n" + PLAY * (1 + i % 3)}) for i in range(40)]
    (tmp_path / "data" / "finetune.jsonl").write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    done = run_cli("run", str(RECIPES / "finetune-hf-llama.toml"), "train.max_steps=4", "train.seq_len=64",
                   "train.micro_batch_size=2", "train.global_batch_tokens=256", "train.eval_every=2",
                   "log.every_steps=1", "run.device=cpu", "--run-dir", str(run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "parameters trainable" in done.stdout

    # The embedding was frozen: exported bitwise equal to the imported one; the rest trained.
    out = tmp_path / "export"
    exported = run_cli("export", str(run_dir), "--format", "hf", "--out", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    before = load_file(tmp_path / "models" / "llama-hf" / "model.safetensors")
    after = load_file(out / "model.safetensors")
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == before["model.embed_tokens.weight"].shape[0]

    # The run's tokenizer is the directory's: the same ids as transformers' tokenizer.
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "models" / "llama-hf")
    from trainbook.data import Tokenizer

    ours = Tokenizer.load(run_dir / "tokenizer")
    assert ours.encode("BERNARDO: Who's there?") == hf_tok.encode("BERNARDO: Who's there?", add_special_tokens=False)


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
