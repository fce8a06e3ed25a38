"""LoRA under FSDP2, tensor parallel, DDP and a pipeline: the real `trainbook run` of a tiny
Hugging Face Llama with adapters on every linear layer, on one process, on two ranks sharding
every block (frozen base weights and trainable adapters in one FSDP unit), on two
tensor-parallel ranks (base, A and B split by the adapter-aware column- and row-wise styles), on
two DDP replicas (gradients all-reduced for the adapters alone) and on two pipeline stages (each
holding its blocks' adapters; pipelines take concatenated packing, so their single process
does too). Each layout equals the single process (losses, adapters) within float tolerance; the base leaves every run bitwise as the
folder holds it; the checkpoints hold optimizer state for the adapters alone (and read back whole
the same as the single process's), and the sharded run's exports for PEFT."""

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


LAYOUTS = {"fsdp": ("parallel.dp_shard=2",), "tp": ("parallel.tp=2",),
           "ddp": ("parallel.data_parallel=ddp", "parallel.dp_replicate=2", "parallel.dp_shard=1"),
           "pp": ("parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=gpipe", "data.packing=concat")}
BANNER = {"fsdp": "dp_shard 2", "tp": "tp 2", "ddp": "dp_replicate 2", "pp": "pp 2"}


def test_lora_under_every_layout_equals_one_process_and_keeps_the_base_frozen(tmp_path):
    _folder(tmp_path)
    singles = {}  # packing override -> (run dir, checkpoint) of the one-process run
    base = load_file(tmp_path / "models" / "llama-hf" / "model.safetensors")
    for layout, overrides in LAYOUTS.items():
        packing = tuple(o for o in overrides if o.startswith("data.packing="))
        if packing not in singles:
            one = tmp_path / f"one{len(singles)}"
            done = run_cli("run", str(RECIPE), *STEPS, *packing, "--run-dir", str(one), cwd=tmp_path)
            assert done.returncode == 0, done.stderr
            singles[packing] = one, _checkpoint(one)
        one, single = singles[packing]
        two = tmp_path / layout
        done = run_cli("run", str(RECIPE), *STEPS, *overrides, "--nproc", "2", "--run-dir", str(two), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert BANNER[layout] in done.stdout, done.stdout[-2000:]

        assert len(_losses(two)) == 3
        torch.testing.assert_close(_losses(two), _losses(one), rtol=0, atol=1e-5, msg=layout)
        ours = _checkpoint(two)
        assert ours.keys() == single.keys(), layout
        assert torch.equal(ours["model.layers.1.attention.wq.weight"], base["model.layers.1.self_attn.q_proj.weight"])
        assert torch.equal(ours["model.layers.0.feed_forward.w2.weight"], base["model.layers.0.mlp.down_proj.weight"])
        for key in (k for k in single if k.startswith("model.")):
            if ".lora_" in key:
                torch.testing.assert_close(ours[key], single[key], rtol=0, atol=1e-5, msg=f"{layout}: {key}")
            else:
                assert torch.equal(ours[key], single[key]), f"{layout}: {key}"
        for key in ("attention.wq", "attention.wo", "feed_forward.w2"):  # column- and row-wise adapters trained
            assert ours[f"model.layers.0.{key}.lora_b.weight"].any(), f"{layout}: {key}"
        optim = [k for k in ours if k.startswith("optim.")]
        assert optim and all(".lora_a." in k or ".lora_b." in k for k in optim), f"{layout}: {optim[:3]}"

        if layout != "fsdp":  # the checkpoints are equal; one export of a sharded run shows it reads back
            continue
        exported = run_cli("export", str(two), "--format", "peft", "--out", str(tmp_path / f"peft-{layout}"),
                           cwd=tmp_path)
        assert exported.returncode == 0, exported.stderr
        adapter = load_file(tmp_path / f"peft-{layout}" / "adapter_model.safetensors")
        assert torch.equal(adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
                           ours["model.layers.0.attention.wq.lora_b.weight"])
