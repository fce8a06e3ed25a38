"""Precision policy: which dtype the forward and backward run in. Weights and optimizer stay fp32."""

from __future__ import annotations

import contextlib

import torch

from trainbook.config import PrecisionConfig

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Precision:
    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.dtype = COMPUTE_DTYPES[cfg.dtype]
        self.device = device

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 through autocast (matmuls in bf16, reductions and the loss in fp32); fp32 as is."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)
