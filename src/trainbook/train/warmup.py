"""Compile before step 1, so that no step's time (nor tokens/s) holds the compile.

One forward and backward of a batch of zeros of the training shape, its gradients dropped, and a
forward as evaluation runs it. Nothing the run computes changes: no RNG is drawn, no weight moves.
"""

from __future__ import annotations

import time

import torch

from trainbook.config import Config
from trainbook.data.samples import Batch
from trainbook.diagnose.profile import device_sync
from trainbook.train.step import Step


def compile_first(step: Step, cfg: Config, evaluate: bool) -> float:
    """Trace and compile what a training step (and, if `evaluate`, an evaluation) runs; seconds."""
    t, engine = cfg.train, step.engine
    device = engine.rt.device
    start = time.perf_counter()
    zeros = torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long, device=device)
    positions = torch.arange(t.seq_len, device=device).expand_as(zeros) if cfg.data.packing == "document" else None
    batch = Batch(zeros, zeros, positions)
    engine.forward_backward(batch, step.objective, step.scaler)
    step.optimizer.zero_grad(set_to_none=True)
    if evaluate:
        with torch.no_grad():
            engine.model.eval()
            engine.eval_loss(batch, step.objective)
            engine.model.train()
    sync = device_sync(device)
    if sync is not None:
        sync()
    return time.perf_counter() - start
