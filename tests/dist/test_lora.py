"""LoRA under FSDP2: the real `trainbook run` of a tiny Hugging Face Llama with adapters, on one
process and on two ranks sharding every block (frozen base weights and trainable adapters in one
FSDP unit). The two equal each other (losses, adapters) within float tolerance; the base leaves
both runs bitwise as the folder holds it; the sharded run's checkpoint holds optimizer state for
the adapters alone, and exports for PEFT like the single process's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.e2e.test_lora import RECIPE, SMALL, _checkpoint, _folder

pytestmark = pytest.mark.slow

STEPS = (*SMALL, "train.max_steps=3", "train.global_batch_tokens=512", "lora.rank=4", "optim.lr=1e-2",
         "schedule.warmup_steps=0")


def _losses(run_dir: Path) -> list[float]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in lines if r["kind"] == "train"]


def test_lora_under_fsdp2_equals_one_process_and_keeps_the_base_frozen(tmp_path):
    _folder(tmp_path)
    one, two = tmp_path / "one", tmp_path / "fsdp"
    done = run_cli("run", str(RECIPE), *STEPS, "--run-dir", str(one), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = run_cli("run", str(RECIPE), *STEPS, "parallel.dp_shard=2", "--nproc", "2", "--run-dir", str(two),
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "dp_shard 2" in done.stdout

    assert len(_losses(two)) == 3
    torch.testing.assert_close(_losses(two), _losses(one), rtol=0, atol=1e-5)
    ours, single = _checkpoint(two), _checkpoint(one)
    assert ours.keys() == single.keys()
    base = load_file(tmp_path / "models" / "llama-hf" / "model.safetensors")
    assert torch.equal(ours["model.layers.1.attention.wq.weight"], base["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(ours["model.layers.0.feed_forward.w2.weight"], base["model.layers.0.mlp.down_proj.weight"])
    for key in (k for k in single if k.startswith("model.")):
        if ".lora_" in key:
            torch.testing.assert_close(ours[key], single[key], rtol=0, atol=1e-5, msg=key)
        else:
            assert torch.equal(ours[key], single[key]), key
    assert ours["model.layers.0.attention.wq.lora_b.weight"].any()  # the adapters trained
    optim = [k for k in ours if k.startswith("optim.")]
    assert optim and all(".lora_a." in k or ".lora_b." in k for k in optim), optim[:3]

    exported = run_cli("export", str(two), "--format", "peft", "--out", str(tmp_path / "peft"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    adapter = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert torch.equal(adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
                       ours["model.layers.0.attention.wq.lora_b.weight"])
