"""`train.compile`: the blocks (and the chunked loss) compiled by parallel/apply.py train like eager
ones; `auto` compiles where it pays, and a run keeps its choice (parallel/compile.py)."""

from __future__ import annotations

import pytest
import torch

from trainbook.config import Config
from trainbook.config.model import ModelConfig
from trainbook.data.samples import Batch
from trainbook.model import build_model, resolve
from trainbook.parallel.apply import ApplyOptions, parallelize
from trainbook.parallel.compile import decide, settle_compile
from trainbook.parallel.dims import ParallelDims
from trainbook.precision import Precision
from trainbook.phase import PhaseTracker
from trainbook.train.engine import LocalEngine
from trainbook.train.step import Step

CPU = torch.device("cpu")


@pytest.mark.slow
def test_compiled_blocks_give_eager_losses():
    """Four steps (two micro-batches each) of the debug model, compiled per block with the chunked
    loss's compiled kernel by the real `parallelize` path, and eager with the full loss: losses within 1e-5 relative (inductor fuses and reorders fp32
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
            parallelize(model, ParallelDims(1, 1, 1, 1), None, ApplyOptions(compile=True, loss="chunked"))
            assert model.chunked_loss.compiled
            assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl for b in model.layers.values())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        it = iter(batches)
        losses = [
            Step.next_token(LocalEngine.one_process(model, Precision(cfg.precision, CPU)), opt, 2, 1.0,
                            Precision(cfg.precision, CPU).loss_scaler(), PhaseTracker())(it).loss
            for _ in range(4)
        ]
        runs[compiled] = losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    (eager, eager_w), (comp, comp_w) = runs[False], runs[True]
    assert eager[-1] < eager[0]  # it trained
    assert comp == pytest.approx(eager, rel=1e-5)
    for k in eager_w:
        torch.testing.assert_close(comp_w[k], eager_w[k], rtol=0, atol=1e-5, msg=k)


ONE = ParallelDims(1, 1, 1, 1)
TB = 1e12  # FLOP/s: a CPU-sized peak


def _auto(dims=ONE, steps=1000, device=CPU, loss="auto", step_flops=1e12, peak=TB):
    return decide("auto", loss, device, dims, step_flops=step_flops, steps=steps, peak_flops=peak)


def test_auto_compiles_a_run_long_enough_to_repay_it_and_chunks_its_loss():
    # 1000 steps of >= 1 s each: at least 100 s saved against ~30 s compiling.
    long = _auto()
    assert (long.compile, long.loss) == (True, "chunked")
    assert "1000 steps save at least ~100 s" in long.reason
    # 500 steps of >= 1 s: ~50 s saved, less than twice the compile: eager, and the full loss.
    short = _auto(steps=500)
    assert (short.compile, short.loss) == (False, "full")
    assert "less than twice the ~30 s compiling takes" in short.reason
    assert _auto(steps=600).compile  # ~60 s saved: twice the compile


@pytest.mark.parametrize("dims, device, why", [
    (ParallelDims(1, 1, 2, 1), CPU, "tensor parallel"),
    (ParallelDims(1, 1, 1, 2), CPU, "pipeline parallel"),
    (ONE, torch.device("hpu"), "no code generator for hpu"),  # as for an NPU without torch_npu's backend
])
def test_auto_stays_eager_where_compile_does_not_run_or_is_not_measured(dims, device, why):
    choice = _auto(dims=dims, device=device)
    assert not choice.compile and why in choice.reason


def test_the_loss_stays_full_where_its_head_is_sharded():
    """Asked for explicitly, the chunked loss is refused with tensor parallel (a DTensor head) and
    with FSDP-sharded pipeline stages; a pipeline without data parallel takes it."""
    tp = decide(True, "chunked", CPU, ParallelDims(1, 1, 2, 1), step_flops=1, steps=1, peak_flops=TB)
    assert tp.loss == "full" and "tensor parallel" in tp.reason
    pp_fsdp = decide(False, "chunked", CPU, ParallelDims(1, 2, 1, 2), step_flops=1, steps=1, peak_flops=TB)
    assert pp_fsdp.loss == "full"
    assert decide(False, "chunked", CPU, ParallelDims(1, 1, 1, 2), step_flops=1, steps=1, peak_flops=TB).loss == "chunked"


def test_a_run_keeps_the_choice_its_first_attempt_made(tmp_path):
    """The record in the run directory wins over a new estimate (a resumed run on a slower host
    compiles as the first attempt did), unless the settings themselves changed."""
    train = Config(train={"max_steps": 1000}).train
    record = tmp_path / "workers" / "compile.json"
    first = settle_compile(record, train, CPU, ONE, step_flops=1e12, peak_flops=TB)
    assert first.compile and record.is_file()
    again = settle_compile(record, train, CPU, ONE, step_flops=1e12, peak_flops=1e15)  # would be eager now
    assert again == first
    forced_off = settle_compile(record, train.model_copy(update={"compile": False}), CPU, ONE,
                                step_flops=1e12, peak_flops=TB)
    assert not forced_off.compile and forced_off.reason.startswith("compile off (train.compile = false)")


def test_an_eager_run_chunks_its_loss_only_past_one_chunk():
    """Eager, a micro-batch of one chunk (2048 tokens: the default recipe's) keeps full logits;
    more than one chunk is chunked (benchmarks/loss.py measured it faster there)."""
    one = decide(False, "auto", CPU, ONE, step_flops=1, steps=1, peak_flops=TB, micro_tokens=2048)
    assert one.loss == "full" and "fit one chunk" in one.reason
    many = decide(False, "auto", CPU, ONE, step_flops=1, steps=1, peak_flops=TB, micro_tokens=16384)
    assert many.loss == "chunked" and "16384 tokens a micro-batch" in many.reason
