"""`train.compile = true`: the blocks compiled by parallel/apply.py train like eager ones."""

from __future__ import annotations

import pytest
import torch

from trainbook.config import Config
from trainbook.config.schema import ModelConfig
from trainbook.data.loader import Batch
from trainbook.model import build_model, resolve
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.dims import ParallelDims
from trainbook.precision import Precision
from trainbook.phase import PhaseTracker
from trainbook.train.engine import LocalEngine
from trainbook.train.step import train_step

CPU = torch.device("cpu")


@pytest.mark.slow
def test_compiled_blocks_give_eager_losses():
    """Four steps (two micro-batches each) of the debug model, compiled per block by the real
    `parallelize` path and eager: losses within 1e-5 relative (inductor fuses and reorders fp32
    arithmetic, so not bitwise), weights after the steps within 1e-5 absolute.

    The first compile of the blocks takes ~30 s on a 2-core CPU."""
    cfg = Config(model=ModelConfig(name="debug"), train={"compile": True})
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 512, (8, 4, 33), generator=g)  # 8 micro-batches of (4, 33)
    batches = [Batch(w[:, :-1], w[:, 1:], None) for w in windows]
    runs = {}
    for compiled in (False, True):
        model = build_model(resolve(cfg.model), CPU, seed=0)
        if compiled:
            parallelize(model, ParallelDims(1, 1, 1, 1), None, ApplyOptions(compile=True))
            assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl for b in model.layers.values())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        it = iter(batches)
        losses = [
            train_step(LocalEngine.one_process(model, Precision(cfg.precision, CPU)), opt, it, 2, 1.0,
                       Precision(cfg.precision, CPU).loss_scaler(), PhaseTracker()).loss
            for _ in range(4)
        ]
        runs[compiled] = losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    (eager, eager_w), (comp, comp_w) = runs[False], runs[True]
    assert eager[-1] < eager[0]  # it trained
    assert comp == pytest.approx(eager, rel=1e-5)
    for k in eager_w:
        torch.testing.assert_close(comp_w[k], eager_w[k], rtol=0, atol=1e-5, msg=k)
