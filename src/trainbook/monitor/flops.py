"""Model FLOPs utilisation: the FLOPs a step needs against what the devices could do.

    MFU = tokens/s x FLOPs per token / (devices x peak FLOP/s of one device)

FLOPs per token are the model's one count (`trainbook.model.count`: PaLM's 6 N + 12 L H Q T,
read off the model built on the meta device). Recomputation under activation checkpointing is not
counted: MFU measures useful work, so turning checkpointing on lowers it.

The peak of one device comes from its maker's datasheet (dense, no sparsity), chosen by the run's
dtype; on CPU there is no datasheet figure to trust, so the peak is measured once by a matmul
probe in the run's dtype. A device not in the table gives no peak (MFU `null`, one warning): a
borrowed number would be worse than none.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trainbook.atomic import atomic_write_json

TFLOPS = 1e12


@dataclass(frozen=True)
class Peak:
    """What one device can do in one dtype, and where the figure comes from."""

    flops: float
    """FLOP/s of one device."""
    device: str
    dtype: str
    source: str


# Dense tensor throughput per device (TFLOP/s): bf16/fp16, tf32 (fp32 matmuls when TF32 is
# allowed) and plain fp32. Matched by substring of the device name, first match wins (so "H100
# PCIe" before "H100"). None: no published figure for that dtype.
DATASHEET: tuple[tuple[str, str, dict[str, float | None], str], ...] = (
    ("H100 PCIe", "H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
     "NVIDIA H100 Tensor Core GPU datasheet (PCIe, dense)"),
    ("H100 NVL", "H100 NVL", {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0},
     "NVIDIA H100 Tensor Core GPU datasheet (NVL, dense)"),
    ("H100", "H100 SXM", {"bf16": 989.4, "tf32": 494.7, "fp32": 67.0},
     "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense)"),
    ("H200 NVL", "H200 NVL", {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0},
     "NVIDIA H200 Tensor Core GPU datasheet (NVL, dense)"),
    ("H200", "H200 SXM", {"bf16": 989.4, "tf32": 494.7, "fp32": 67.0},
     "NVIDIA H200 Tensor Core GPU datasheet (SXM, dense)"),
    ("A100", "A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
     "NVIDIA A100 Tensor Core GPU datasheet (dense)"),
    ("B200", "B200", {"bf16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
     "NVIDIA HGX B200 specifications, per GPU (board figures / 8, dense)"),
    ("L40S", "L40S", {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6},
     "NVIDIA L40S datasheet (dense)"),
    ("910B", "Ascend 910B", {"bf16": 320.0, "tf32": None, "fp32": None},
     "Huawei Ascend 910B, FP16/BF16 figure published for Atlas 800T A2; no FP32 matmul figure"),
    ("910C", "Ascend 910C", {"bf16": 800.0, "tf32": None, "fp32": None},
     "Huawei Ascend 910C, FP16 figure from Huawei Connect 2025; no FP32 matmul figure"),
    ("910_93", "Ascend 910C", {"bf16": 800.0, "tf32": None, "fp32": None},
     "Huawei Ascend 910C (device name Ascend910_93xx), FP16 figure from Huawei Connect 2025"),
)


def _datasheet_dtype(dtype: str) -> str:
    if dtype in ("bf16", "fp16"):
        return "bf16"
    # fp32 matmuls run on tensor cores only when TF32 is allowed ("high"/"medium").
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def published_peak(device_name: str, dtype: str) -> Peak | None:
    """The datasheet peak of a device by its name (e.g. "NVIDIA H100 80GB HBM3"); None if unknown."""
    key = _datasheet_dtype(dtype)
    for match, name, figures, source in DATASHEET:
        if match.lower() in device_name.lower():
            flops = figures.get(key)
            return Peak(flops * TFLOPS, name, key, source) if flops else None
    return None


def matmul_flops(device: torch.device, dtype: str = "fp32", n: int = 1024, inner: int = 8, reps: int = 5,
                 repeat: int = 1, budget_s: float = 2.0) -> float:
    """FLOP/s of `inner` chained (n x n) @ (n x n) matmuls in `dtype`, the best of `reps` timings
    (the best is what the hardware can do; a busy neighbour only ever makes one slower). The one
    matmul probe: the CPU peak MFU is measured against, and `trainbook check`'s per-rank probe.
    `repeat` > 1 does every matmul that many times but counts it once (`check.slow_matmul`).
    A dtype the hardware has no fast path for (fp16 on many CPUs: about 1 GFLOP/s, two seconds a
    1024 x 1024 product) gets fewer timings and shorter chains, about `budget_s` in all, not the
    minutes the full probe would take."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Scaled by 1/sqrt(n) so that chained products stay O(1), never overflowing fp16.
    a = (torch.randn(n, n, generator=gen) / n**0.5).to(device, torch_dtype)
    b = (torch.randn(n, n, generator=gen) / n**0.5).to(device, torch_dtype)
    start = time.perf_counter()
    torch.mm(a, b)  # warm-up: kernels chosen, pages touched
    _sync(device)
    one = (time.perf_counter() - start) * repeat  # a chain link's seconds, at most (the warm-up is the slowest)
    if one * inner * reps > budget_s:
        inner = max(1, min(inner, int(budget_s / (one * reps))))
        reps = max(1, min(reps, int(budget_s / (one * inner))))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        x = a
        for _ in range(inner):
            for _ in range(repeat):
                y = torch.mm(x, b)
            x = y
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 * inner / best


def _sync(device: torch.device) -> None:
    if device.type in ("cuda", "npu"):
        getattr(torch, device.type).synchronize(device)


PEAK_PROBE_BUDGET_S = 0.5
"""Seconds a run's start-up gives the CPU peak probe. An idle 2-core CPU does the whole probe in
about 0.4 s; a busy one (the probe then measures the load, not the CPU) used to take the probe's
general 2 s on every rank of every run."""


def measure_matmul_peak(device: torch.device, dtype: str, n: int = 1024) -> Peak:
    """The best square-matmul throughput of this process on `device` (`matmul_flops`): the
    CPU's practical peak with the threads this run uses."""
    return Peak(matmul_flops(device, dtype, n, budget_s=PEAK_PROBE_BUDGET_S), f"cpu ({torch.get_num_threads()} threads)",
                dtype, f"measured: best of up to 5 x 8 chained {n}x{n} matmuls in {dtype}")


def _cached_peak(cache: Path, dtype: str) -> Peak | None:
    try:
        peak = Peak(**json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    threads = f"cpu ({torch.get_num_threads()} threads)"
    return peak if (peak.device, peak.dtype) == (threads, dtype) else None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)
    return "cpu"


def device_peak(device: torch.device, dtype: str, cache: Path | None = None) -> tuple[Peak | None, str]:
    """The peak MFU is measured against, and a note: what it is, or why there is none.

    `cache`: a file where a CPU peak measured by an earlier attempt of the run on this host is
    kept: an elastic restart reuses it instead of measuring again (half a second of start-up)."""
    if device.type == "cpu":
        peak = _cached_peak(cache, dtype) if cache is not None else None
        if peak is None:
            peak = measure_matmul_peak(device, dtype)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(cache, asdict(peak))
        return peak, f"MFU peak: {peak.flops / TFLOPS:.3g} TFLOP/s per rank ({peak.source})"
    name = device_name(device)
    peak = published_peak(name, dtype)
    if peak is None:
        return None, (f"no published {dtype} peak for device {name!r}: MFU is not computed "
                      "(metrics.jsonl writes null)")
    return peak, f"MFU peak: {peak.flops / TFLOPS:.4g} TFLOP/s per device ({peak.device} {peak.dtype}; {peak.source})"


def mfu(tokens_per_s: float, flops_per_token: float, peak: Peak | None, devices: int) -> float | None:
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (devices * peak.flops)
