"""MFU's two halves: FLOPs per token against torch's own FLOP counter, and the peak table."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from trainbook.config import ModelConfig
from trainbook.model import build_model, flops_per_token, resolve
from trainbook.monitor.flops import TFLOPS, measure_matmul_peak, mfu, published_peak
from trainbook.train.engine import lm_loss


@pytest.mark.parametrize("overrides", [
    {}, {"tie_embeddings": False, "n_kv_heads": 6},
    {"name": "qwen3-tiny"},  # q/k norms, head_dim 32 where dim / n_heads = 16
    {"name": "qwen3-tiny", "family": "qwen2", "qk_norm": False, "head_dim": None},  # q/k/v biases
])  # fmt: skip
def test_flops_per_token_is_what_a_training_step_computes(overrides):
    """6N + 12LHQT equals the FLOPs torch counts in one forward and backward: every matmul, and
    attention's two (run as plain matmuls here: the counter does not see the CPU's fused kernel);
    embedding lookups, norms and biases count none."""
    cfg = resolve(ModelConfig(**{"name": "tiny", "vocab_size": 512, **overrides}))
    model = build_model(cfg, torch.device("cpu"), seed=0)
    batch, seq = 2, 64
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        lm_loss(model(tokens), tokens).backward()
    assert flops_per_token(cfg, seq) == pytest.approx(counter.get_total_flops() / (batch * seq), rel=1e-9)


def test_peaks_come_from_the_table_by_device_name_and_dtype():
    h100 = published_peak("NVIDIA H100 80GB HBM3", "bf16")
    assert (h100.flops, h100.device) == (989.4 * TFLOPS, "H100 SXM")
    assert published_peak("NVIDIA H100 PCIe", "bf16").flops == 756.0 * TFLOPS
    assert published_peak("NVIDIA A100-SXM4-80GB", "fp32").flops == 19.5 * TFLOPS  # TF32 off: plain fp32
    assert published_peak("Ascend910B3", "bf16").flops == 320.0 * TFLOPS
    # Unknown device, or no published figure for the dtype: no peak at all, never a borrowed one.
    assert published_peak("NVIDIA GeForce GTX 1080", "bf16") is None
    assert published_peak("Ascend910B3", "fp32") is None
    assert mfu(1000.0, 1e9, None, 8) is None


def test_tf32_picks_the_tensor_core_fp32_peak():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert published_peak("NVIDIA H200", "fp32").flops == 494.7 * TFLOPS
    finally:
        torch.set_float32_matmul_precision(before)


def test_cpu_probe_measures_a_peak_that_bounds_mfu():
    peak = measure_matmul_peak(torch.device("cpu"), "fp32", n=256)
    assert peak.flops > 0 and "measured" in peak.source
    # A step that ran exactly at the probe's rate on every device is MFU 1.
    assert mfu(peak.flops * 4 / 1e6, 1e6, peak, 4) == pytest.approx(1.0)


class CountMatmuls(TorchDispatchMode):
    """Counts the aten.mm calls made while it is entered (the probe's matmuls)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def test_a_slow_dtype_gets_a_probe_within_its_budget():
    """The probe's matmuls, counted: the full 5 x 8 chain (and the warm-up) when the budget allows
    it, a single timing of a single matmul when one already takes longer than the budget (as an
    fp16 product does on a CPU with no fp16 path: ~2 s each, 90 s for the full probe)."""
    from trainbook.monitor.flops import matmul_flops

    for budget, expected in ((float("inf"), 1 + 5 * 8), (0.0, 1 + 1)):
        with CountMatmuls() as counter:
            assert matmul_flops(torch.device("cpu"), "fp32", n=64, budget_s=budget) > 0
        assert counter.count == expected, (budget, counter.count)


def test_a_runs_cpu_peak_probe_keeps_to_the_start_up_budget(monkeypatch):
    """Every CPU run measures its peak before step 1 (train/settle.py): that probe keeps to
    `PEAK_PROBE_BUDGET_S`, not the 2 s of `check`'s probe. With no budget at all, one timing of one
    matmul after the warm-up."""
    from trainbook.monitor import flops

    monkeypatch.setattr(flops, "PEAK_PROBE_BUDGET_S", 0.0)
    with CountMatmuls() as counter:
        assert measure_matmul_peak(torch.device("cpu"), "fp32", n=64).flops > 0
    assert counter.count == 1 + 1
