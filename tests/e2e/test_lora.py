"""LoRA end to end: a run of the fine-tuning recipe with `lora.rank`, started from a Hugging Face
Llama folder, sampled from, exported for PEFT (`--format peft`) and merged (`--format hf`); PEFT's
`PeftModel.from_pretrained` on the adapter and the base folder computes trainbook's logits.
Bad input: targets that name no module (one line, exit 2, nothing
written), `--format peft` of a run without adapters (refused before anything is written)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import PLAY, RECIPES, run_cli, run_cli_error, write_hf_llama
from trainbook.checkpoint import load_state, locate, tensor_entries
from trainbook.checkpoint.store import MANIFEST
from trainbook.commands.export import export
from trainbook.config import load_config
from trainbook.data import Tokenizer
from trainbook.errors import TrainbookError
from trainbook.model import build_model, generate
from trainbook.model.lora import apply_lora

RECIPE = RECIPES / "finetune-hf-llama.toml"
SMALL = ("model.init_from=hf:models/llama-hf", "train.seq_len=64", "train.micro_batch_size=2",
         "train.global_batch_tokens=256", "train.eval_every=0", "log.every_steps=1", "run.device=cpu")


def _folder(tmp_path: Path) -> None:
    write_hf_llama(tmp_path / "models" / "llama-hf")
    (tmp_path / "data").mkdir()
    lines = [json.dumps({"text": f"SCENE {i}.\n" + PLAY * (1 + i % 3)}) for i in range(40)]
    (tmp_path / "data" / "finetune.jsonl").write_text("\n".join(lines) + "\n")


def _trainbook_model(run_dir: Path) -> torch.nn.Module:
    """The run's newest checkpoint, adapters included, in trainbook's own model."""
    cfg = load_config(run_dir / "config.resolved.toml")
    model = build_model(cfg.model, "cpu", seed=0)
    apply_lora(model, cfg.lora, seed=0)
    state = {"model": model.state_dict()}
    load_state(locate(run_dir)[1], state)
    model.load_state_dict(state["model"])
    return model


@pytest.mark.slow
def test_a_lora_run_exports_adapters_peft_loads_with_trainbook_s_logits(tmp_path):
    peft = pytest.importorskip("peft")
    import transformers
    from safetensors.torch import load_file

    _folder(tmp_path)
    run_dir = tmp_path / "run"
    # lr 1e-2: three steps move B far enough from zero that a dropped adapter shows in the logits.
    done = run_cli("run", str(RECIPE), *SMALL, "train.max_steps=3", "lora.rank=4", "lora.alpha=8",
                   "lora.targets=wq,wk,wv,wo,w1,w2,w3", "optim.lr=1e-2", "schedule.warmup_steps=0",
                   "--run-dir", str(run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "LoRA rank 4, alpha 8 (scale 2) on 14 linear layers" in done.stdout

    # `sample` continues greedily as the adapted model does (not as the base, which it would be
    # if it left the adapters out: loading a checkpoint skips the keys a model does not ask for).
    ours_model = _trainbook_model(run_dir)
    tokenizer = Tokenizer.load(run_dir / "tokenizer")
    greedy = tokenizer.decode(generate(ours_model, tokenizer.encode("BERNARDO:"), 12, temperature=0.0))
    sampled = run_cli("sample", str(run_dir), "--prompt", "BERNARDO:", "--max-new-tokens", "12", "--temperature", "0")
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.rstrip("\n") == "BERNARDO:" + greedy.rstrip("\n")

    peft_dir, hf_dir = tmp_path / "peft", tmp_path / "merged"
    exported = run_cli("export", str(run_dir), "--format", "peft", "--out", str(peft_dir), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    export(run_dir, "hf", hf_dir)  # in this process: a second CLI start costs ~5-10 s
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8}
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    adapter = load_file(peft_dir / "adapter_model.safetensors")
    assert adapter["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert adapter["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert len(adapter) == 2 * 7 * 2

    base_folder = tmp_path / "models" / "llama-hf"
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = ours_model(tokens)
        base = transformers.AutoModelForCausalLM.from_pretrained(base_folder)(tokens).logits
        theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_folder),
                                                peft_dir)(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)(tokens).logits
    assert (theirs - base).abs().max() > 1e-2  # the adapters trained and PEFT applied them
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, ours, rtol=0, atol=1e-5)
    # The merged folder holds the base's names only, and the frozen embedding is the folder's.
    before, after = load_file(base_folder / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert after.keys() == before.keys()
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])

    # A run without adapters has nothing to export for PEFT: its checkpoint, as one (a copy whose
    # manifest says rank 0), refused before anything is read or written.
    plain = tmp_path / "plain-step-3"
    shutil.copytree(locate(run_dir)[1], plain)
    manifest = json.loads((plain / MANIFEST).read_text())
    manifest["config"]["lora"]["rank"] = 0
    (plain / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(TrainbookError) as refused:
        export(plain, "peft", tmp_path / "none")
    assert str(refused.value) == ("--format peft: the run trained no LoRA adapters (lora.rank = 0); "
                                  "export it with --format hf or safetensors")
    assert not (tmp_path / "none").exists() and not (tmp_path / "none.tmp").exists()


def _metrics(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def _checkpoint(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint: model (base and adapters) and optimizer."""
    ckpt = locate(run_dir)[1]
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in tensor_entries(ckpt).items() if key.startswith(("model.", "optim."))}
    load_state(ckpt, state)
    return state


@pytest.mark.slow
def test_a_killed_lora_run_resumes_bitwise_with_its_adapters_and_their_optimizer_state(tmp_path):
    """Accumulation 2, warmup past the first checkpoint and dropout on the adapters' input, so a
    resume that lost the adapters, their moments, the schedule or the RNG would change the losses."""
    _folder(tmp_path)
    steps = (*SMALL, "train.max_steps=4", "train.global_batch_tokens=512", "checkpoint.interval_steps=2",
             "schedule.warmup_steps=3", "lora.rank=4", "lora.dropout=0.1", "optim.lr=1e-2")
    straight, run_dir = tmp_path / "straight", tmp_path / "killed"
    done = run_cli("run", str(RECIPE), *steps, "--run-dir", str(straight), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    killed = run_cli("run", str(RECIPE), *steps, "--run-dir", str(run_dir), cwd=tmp_path,
                     env={"TRAINBOOK_FAULT": "train.after_step@3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_cli("run", "--run-dir", str(run_dir), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "step-2 at step 2" in resumed.stdout

    assert _metrics(run_dir) == _metrics(straight) and len(_metrics(straight)) == 4
    ours, theirs = _checkpoint(run_dir), _checkpoint(straight)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # The checkpoint holds every weight, and optimizer state for the adapters alone.
    assert "model.layers.0.attention.wq.weight" in theirs and "model.layers.0.attention.wq.lora_b.weight" in theirs
    optim = [k for k in theirs if k.startswith("optim.")]
    assert optim and all(".lora_a." in k or ".lora_b." in k for k in optim), optim[:3]


def test_lora_bad_input_is_one_line_exit_2_nothing_written(tmp_path):
    write_hf_llama(tmp_path / "models" / "llama-hf")
    nowhere = run_cli_error("run", str(RECIPE), "train.seq_len=64", "lora.rank=4", "lora.targets=wq,q_proj",
                            cwd=tmp_path, watch=(RECIPES,))
    assert nowhere == (f"trainbook: error: {RECIPE}: lora.targets: 'q_proj' names no module of the model (its linear "
                       "layers: w1, w2, w3, wk, wo, wq, wv; or 'all-linear')")
