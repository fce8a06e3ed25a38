"""Activation checkpointing changes what is recomputed, never the numbers; the fp32 ops stay fp32
under FSDP2's mixed-precision policy. Real FSDP2 x 2 ranks (torch.distributed.run, gloo, one
launch for both: tests/dist/fsdp_numerics_worker.py), and checkpointing in one process too.

Checkpointing: the loss and every parameter's gradient under `full` and `selective` equal those
of `none` (within 1e-6; on CPU they are bitwise equal), and the ops that run in backward show each
mode really recomputed what it should: `full` the blocks' forward (up to the last op whose output
backward needs: torch stops recomputing there, so each block's final matmul, w2, is not rerun),
`selective` only what it does not save: the norms' statistics, no matmul and no attention.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.fsdp_numerics_worker import COUNTED, MODES, debug_model, run_pass
from tests.unit.train.test_precision import CHECKS
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.dims import ParallelDims
from trainbook.precision import COMPUTE_DTYPES

ROOT = Path(__file__).resolve().parents[2]
N_LAYERS = 2  # the debug model's blocks
SDPA = "_scaled_dot_product_flash_attention_for_cpu"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_numerics")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.dist.fsdp_numerics_worker", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    log = proc.stdout + proc.stderr
    files = [out / f"rank{r}.pt" for r in range(2)]
    assert all(f.exists() for f in files), log[-3000:]
    assert proc.returncode == 0, log[-3000:]
    return [torch.load(f, weights_only=True) for f in files]


def assert_only_recomputation_differs(runs: dict[str, dict], names: set[str]) -> None:
    none = runs["none"]
    # Every block ran its forward once: 7 matmuls, 2 norms, 1 attention.
    assert none["forward"] == {"mm": 7 * N_LAYERS, "rsqrt": 2 * N_LAYERS, SDPA: N_LAYERS}
    assert set(none["grads"]) == names and all(g.abs().sum() > 0 for g in none["grads"].values())
    recompute = {"full": {"mm": 6 * N_LAYERS, "rsqrt": 2 * N_LAYERS, SDPA: N_LAYERS},
                 "selective": {"mm": 0, "rsqrt": 2 * N_LAYERS, SDPA: 0}}
    for mode in ("full", "selective"):
        run = runs[mode]
        assert run["forward"] == none["forward"], mode
        assert abs(run["loss"].item() - none["loss"].item()) <= 1e-6, mode
        assert set(run["grads"]) == names, mode
        for name, grad in run["grads"].items():
            assert (grad - none["grads"][name]).abs().max().item() <= 1e-6, (mode, name)
        rerun = {op: run["backward"].get(op, 0) - none["backward"].get(op, 0) for op in COUNTED}
        assert rerun == recompute[mode], mode


def test_checkpointing_changes_only_what_is_recomputed_in_one_process():
    batch = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    one = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1)
    runs = {mode: run_pass(parallelize(debug_model(), one, None, ApplyOptions(mode)), batch) for mode in MODES}
    assert_only_recomputation_differs(runs, {n for n, _ in debug_model().named_parameters()})


def test_checkpointing_changes_only_what_is_recomputed_under_fsdp2(ranks):
    names = {n for n, _ in debug_model().named_parameters()}
    for rank in ranks:
        assert_only_recomputation_differs(rank["checkpointing"], names)
    # The ranks read different rows and reduce one gradient.
    assert ranks[0]["checkpointing"]["none"]["loss"] != ranks[1]["checkpointing"]["none"]["loss"]
    for name, grad in ranks[0]["checkpointing"]["none"]["grads"].items():
        assert torch.equal(grad, ranks[1]["checkpointing"]["none"]["grads"][name]), name


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp32_ops_compute_in_fp32_under_fsdp2(ranks, dtype):
    """FSDP2's policy casts the gathered parameters (the matmuls run low), not the blocks' inputs:
    each block gets the residual stream in the compute dtype and the RoPE tables in fp32."""
    low = COMPUTE_DTYPES[dtype]
    for rank in ranks:
        for trace, mask in zip(rank["fp32_ops"][dtype], (None, torch.bool)):
            assert trace["block_inputs"] == [[low, torch.float32, torch.float32, mask, None]] * N_LAYERS
            ops = [tuple(o) for o in trace["ops"]]
            assert any(o[1] == "mm" and set(o[2]) == {low} for o in ops)  # the matmuls are low precision
            for name, check in CHECKS.items():
                check(ops, N_LAYERS)


def test_bf16_gradient_reduction_sends_bf16_and_keeps_the_fp32_gradient(ranks):
    """`parallel.reduce_dtype = "bf16"`: every reduced gradient element is a bf16 number (it went
    through the reduce-scatter in bf16; the fp32 reduction's are not), held in fp32 for the
    optimizer, within bf16's rounding (2^-7 of the largest entry) of the fp32 reduction."""
    for rank in ranks:
        assert rank["grad_dtypes"] == ["torch.float32"]
        fp32, bf16 = rank["checkpointing"]["none"]["grads"], rank["reduce_bf16"]["grads"]
        assert not all(torch.equal(g, g.bfloat16().float()) for g in fp32.values())
        for name, grad in bf16.items():
            assert grad.dtype == torch.float32 and torch.equal(grad, grad.bfloat16().float()), name
            assert (grad - fp32[name]).abs().max() <= 2.0**-7 * fp32[name].abs().max(), name
