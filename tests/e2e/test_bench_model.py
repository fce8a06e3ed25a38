"""`trainbook bench model`: the recipe's model alone on synthetic tokens (the real CLI)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli, run_cli_error, write_recipe
from trainbook.config import ModelConfig
from trainbook.model import build_model, flops_per_token, num_params, resolve


@pytest.mark.parametrize("name", ["tiny", "qwen3-tiny"])  # Llama; Qwen3 (q/k norms, head_dim != dim / n_heads)
def test_bench_model_reports_rate_mfu_split_and_memory_without_data(tmp_path, name):
    """No data is prepared (the recipe's corpus does not even exist); the figures hang together:
    tokens/s is the step's tokens over its median time, MFU is tokens/s x FLOPs per token over
    the measured peak, the phases add up to the step, and the plan's estimate is given."""
    recipe = write_recipe(tmp_path / "unit.toml", tmp_path / "no-such-corpus")
    out = tmp_path / "bench.json"
    done = run_cli("bench", "model", str(recipe), f"model.name={name}", "train.micro_batch_size=2",
                   "train.compile=false", "--steps", "3", "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    b = json.loads(out.read_text())
    assert not (tmp_path / "runs").exists()  # nothing prepared, no run directory
    model = resolve(ModelConfig(name=name, vocab_size=512))  # the recipe's vocabulary
    assert b["params"] == num_params(build_model(model, "meta", 0))
    assert b["tokens_per_step"] == 256  # global_batch_tokens: 4 micro-batches of 2 x 32
    assert b["tokens_per_s"] == pytest.approx(b["tokens_per_step"] / b["step_s"])
    flops = flops_per_token(model, 32)
    assert b["mfu"] == pytest.approx(b["tokens_per_s"] * flops / b["peak_flops"])
    # Positive, not below 1: the CPU's peak is probed beside the suite's other workers, whose load
    # may change between the probe and the steps (1.08 seen in a full run; the accelerator dry run
    # asks the same).
    assert b["mfu"] > 0
    assert set(b["phases"]) == {"forward", "backward", "optimizer", "other"}
    assert all(v >= 0 for k, v in b["phases"].items() if k != "other")
    assert sum(b["phases"].values()) == pytest.approx(b["step_s"], rel=0.05)
    assert (b["compile"], b["loss"]) == (False, "full") and "train.compile = false" in b["choice"]
    assert b["mem_peak_bytes"] > 0 and b["plan_bytes"] > 0
    text = done.stdout
    assert f"{b['tokens_per_s']:,.0f} tokens/s" in text and f"MFU {b['mfu']:.1%}" in text
    assert "forward" in text and "plan estimates" in text


def test_bench_model_refuses_bad_input_in_one_line(recipe, tmp_path):
    line = run_cli_error("bench", "model", str(recipe), "train.compile=sometimes", cwd=tmp_path)
    assert "train.compile" in line


def test_bench_model_applies_lora_as_a_run_does(tmp_path):
    """`[lora]` in the recipe: the model is benched with its adapters and its base frozen, as a run
    trains it, and the plan beside it is LoRA's (the frozen base without gradients or optimizer
    state), so LoRA and full training compare on one recipe."""
    from trainbook.config import LoraConfig
    from trainbook.model.lora import apply_lora
    from trainbook.model.surgery import trainable_summary

    recipe = write_recipe(tmp_path / "unit.toml", tmp_path / "no-such-corpus")
    out = tmp_path / "bench.json"
    done = run_cli("bench", "model", str(recipe), "lora.rank=4", "lora.targets=wq,wv", "train.micro_batch_size=2",
                   "train.compile=false", "--steps", "2", "--json", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    b = json.loads(out.read_text())
    model = build_model(resolve(ModelConfig(name="debug", vocab_size=512)), "meta", 0)  # the recipe's
    apply_lora(model, LoraConfig(rank=4, targets=["wq", "wv"]), 0)
    assert b["trainable"] == trainable_summary(model) and "LoRA" in b["trainable"]
    assert b["params"] == num_params(model) and f"  {b['trainable']}" in done.stdout
