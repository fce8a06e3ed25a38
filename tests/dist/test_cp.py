"""Context parallelism computes what one process computes: 4 real gloo ranks, FSDP x 2 over
context parallel x 2 (tests/dist/cp_worker.py, one launch), against the whole model on the whole
batch, 3 AdamW steps in fp64, for each case: the tiny Llama with head-tail balancing and with
contiguous shares, with documents packed into the windows (a document crossing the shares), the
same with full and with selective activation checkpointing, a tiny Qwen3 and multi-head latent
attention. The CLI under cp = 2 (20 steps, its checkpoint resumed, layer statistics):
tests/dist/test_layouts.py's `cp2`, `cp2-tp2` and `cp2-pp2`.

Measured here: logits bit for bit (each rank's share gathered and put back in sequence order),
gradient norms within 3e-16, parameters within 2e-13 after 3 steps; the losses within 1.2e-7,
since the loss is computed in fp32 whatever the model's dtype (model/loss.py) and each rank
averages its own share before the ranks' mean. The bound asked of them is 1e-6.

A mask built from the positions of a rank's share as if it were a sequence of its own (its
queries at 0..T/cp-1) instead of their places in the whole sequence fails every case: the
logits differ from the first step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
REL = 1e-6
CASES = ["llama-head-tail", "llama-contiguous", "llama-documents", "qwen3", "mla", "llama-full-ac",
         "llama-selective-ac"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "tests.dist.cp_worker", str(out), "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    files = [out / f"rank{r}.pt" for r in range(4)]
    assert proc.returncode == 0 and all(f.exists() for f in files), (proc.stdout + proc.stderr)[-3000:]
    return [torch.load(f, weights_only=True) for f in files]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_ranks_train_as_one_process(ranks, case):
    for rank, result in enumerate(ranks):
        ref, cp = result[case]["ref"], result[case]["cp"]
        assert torch.equal(cp["logits"], ref["logits"]), (case, rank, _relative(cp["logits"], ref["logits"]))
        for step, (a, b) in enumerate(zip(cp["steps"], ref["steps"]), start=1):
            assert abs(a["loss"] - b["loss"]) <= REL * abs(b["loss"]), (case, rank, step, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= REL * abs(b["grad_norm"]), (case, rank, step, a, b)
        assert cp["state"].keys() == ref["state"].keys()
        for name, tensor in ref["state"].items():
            assert _relative(cp["state"][name], tensor) <= REL, (case, rank, name)
    # The cp ranks of each data-parallel rank held different shares, and together trained on it.
    assert {r[case]["cp_rank"] for r in ranks} == {0, 1}
