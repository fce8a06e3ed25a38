"""The step's seams, on a real model: the observer meets the step at its points in order, and an
objective other than next-token plugs in without the step or the loop knowing (here the shape
supervised fine-tuning will take: a loss mask, normalised by the trained tokens of the whole
step, the count reported)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainbook.config.model import ModelConfig
from trainbook.data.chat import DOC_START, TRAINED
from trainbook.data.samples import Batch, to_batch
from trainbook.model import build_model, resolve
from trainbook.model.loss import ChunkedLoss
from trainbook.phase import PhaseTracker
from trainbook.precision import Precision
from trainbook.config import PrecisionConfig
from trainbook.train.engine import LocalEngine
from trainbook.train.objective import MaskedTokenLoss, MicroLoss, NextTokenLoss, masked_loss_sum, trained_tokens
from trainbook.train.observers import StepObserver
from trainbook.train.step import Step

CPU = torch.device("cpu")


def _model():
    return build_model(resolve(ModelConfig(name="debug")), CPU, seed=0)


def _batches(n: int, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w = torch.randint(0, 256, (2, 17), generator=g)
        out.append(Batch(w[:, :-1], w[:, 1:], None))
    return out


def _step(model, objective, micro_batches: int) -> Step:
    precision = Precision(PrecisionConfig(), CPU)
    return Step(LocalEngine.one_process(model, precision), objective, torch.optim.SGD(model.parameters(), lr=0.1),
                precision.loss_scaler(), PhaseTracker(), 0.0, micro_batches)


class Recorder(StepObserver):
    def __init__(self):
        self.seen = []

    def at(self, point: str) -> None:
        self.seen.append(point)

    def observe_grads(self) -> None:
        self.seen.append("observe_grads")

    def before_update(self) -> None:
        self.seen.append("before_update")


def test_the_step_meets_its_observer_at_each_point_in_order():
    model = _model()
    step = _step(model, NextTokenLoss(2), 2)
    step.tracker.begin_step(1)
    recorder = Recorder()
    step(iter(_batches(2)), recorder)
    assert recorder.seen == ["start", "data", "data", "compute", "observe_grads", "before_update"]
    # A step its judge rejects meets no update: the weights stay as they are.
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recorder.seen.clear()
    step.tracker.begin_step(2)
    result = step(iter(_batches(2, seed=1)), recorder, judge=lambda loss, norm: "bad")
    assert result.rejected == "bad" and "before_update" not in recorder.seen
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class MaskedTokens:
    """Fine-tuning's shape: only tokens whose target is odd are trained; the step's loss is their
    mean over every micro-batch of the step (one process here: the count is this rank's)."""

    def __init__(self, micro_batches: int):
        self.micro_batches, self.count = micro_batches, 0

    def produce(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        while True:  # the step's micro-batches read ahead: the count is known before any backward
            step = [next(batches) for _ in range(self.micro_batches)]
            self.count = sum(int((b.targets % 2 == 1).sum()) for b in step)
            yield from step

    def loss(self, model, batch: Batch) -> MicroLoss:
        logits = model(batch.inputs).float()
        losses = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none")
        return MicroLoss((losses * (batch.targets.flatten() % 2 == 1)).sum(), self.count)

    def eval_loss(self, model, batch: Batch) -> torch.Tensor:
        return self.loss(model, batch).value / max(int((batch.targets % 2 == 1).sum()), 1)

    def finish(self, loss_sum: torch.Tensor, micro_batches: int) -> torch.Tensor:
        return loss_sum / self.count

    def figures(self) -> dict:
        return {"trained_tokens": self.count}


def test_an_objective_with_a_loss_mask_plugs_into_the_step():
    batches = _batches(3)
    model, reference = _model(), _model()
    objective = MaskedTokens(3)
    step = _step(model, objective, 3)
    step.tracker.begin_step(1)
    result = step(objective.produce(iter(batches)), Recorder())

    # By hand: the masked mean over all three micro-batches at once, one backward, one update.
    inputs = torch.cat([b.inputs for b in batches])
    targets = torch.cat([b.targets for b in batches])
    mask = (targets % 2 == 1).flatten()
    losses = F.cross_entropy(reference(inputs).float().flatten(0, 1), targets.flatten(), reduction="none")
    expected = (losses * mask).sum() / mask.sum()
    expected.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad

    assert result.figures == {"trained_tokens": int(mask.sum())}
    assert abs(result.loss - expected.item()) < 1e-5
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


# ---- supervised fine-tuning: MaskedTokenLoss, the objective chat data trains with ----------------

SEQ = 64


def _sft_samples(trained: list[int], seed: int = 0) -> list[Batch]:
    """One sample (1, SEQ) per entry, its loss mask training that many targets (at random places)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in trained:
        w = torch.randint(0, 512, (1, SEQ + 1), generator=g)
        mask = torch.zeros(1, SEQ, dtype=torch.bool)
        mask[0, torch.randperm(SEQ, generator=g)[:n]] = True
        out.append(Batch(w[:, :-1], w[:, 1:], None, loss_mask=mask))
    return out


def _stacked(batches: list[Batch]) -> Batch:
    return Batch(*(None if parts[0] is None else torch.cat(parts) for parts in zip(*batches)))


class Grads(StepObserver):
    """The step's final gradients, before clipping and the update."""

    def __init__(self, model):
        self.model, self.grads = model, {}

    def observe_grads(self) -> None:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}


def _sft_step(micro_batches: list[Batch], chunked: bool):
    model = _model()
    if chunked:
        model.chunked_loss = ChunkedLoss(chunk_tokens=16)
    rt = LocalEngine.one_process(model, Precision(PrecisionConfig(), CPU)).rt  # one process: dp = tp = 1
    objective = MaskedTokenLoss(len(micro_batches), rt)
    step = _step(model, objective, len(micro_batches))
    step.tracker.begin_step(1)
    grads = Grads(model)
    result = step(objective.produce(iter(micro_batches)), grads)
    return result, grads.grads


@pytest.mark.parametrize("chunked", [False, True], ids=["full", "chunked"])
def test_accumulation_weighs_each_trained_token_once(chunked):
    """Micro-batch 1 x accumulation 8 equals micro-batch 8 x accumulation 1 (gradients within
    1e-6) on samples training 1 and 50 targets among others: the loss is the sum over every
    trained token of the step over their count, not a mean of micro-batch means (under which
    the one-token micro-batch would weigh as much as the fifty-token one)."""
    samples = _sft_samples([1, 50, 3, 1, 40, 2, 50, 1])
    one_by_eight, grads_a = _sft_step(samples, chunked)
    eight_by_one, grads_b = _sft_step([_stacked(samples)], chunked)
    assert one_by_eight.figures == eight_by_one.figures == {"trained_tokens": 148}
    assert abs(one_by_eight.loss - eight_by_one.loss) < 1e-6
    for name, g in grads_a.items():
        torch.testing.assert_close(g, grads_b[name], rtol=0, atol=1e-6, msg=name)

    # Both are the gradient of the per-token mean over the whole step, computed by hand.
    reference = _model()
    batch = _stacked(samples)
    losses = F.cross_entropy(reference(batch.inputs).float().flatten(0, 1), batch.targets.flatten(),
                             reduction="none")
    mask = batch.loss_mask.flatten()
    expected = losses[mask].sum() / mask.sum()
    expected.backward()
    assert abs(one_by_eight.loss - expected.item()) < 1e-5
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads_a[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_step_without_trained_tokens_trains_nothing():
    result, grads = _sft_step(_sft_samples([0, 0]), chunked=False)
    assert result.figures == {"trained_tokens": 0} and result.loss == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


EOS = 511


def _document(length: int, trained_from: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A document of `length` tokens (EOS last) and its mask bytes, trained from `trained_from` on."""
    ids = np.random.default_rng(seed).integers(0, EOS, length)
    ids[-1] = EOS
    bits = np.zeros(length, dtype=np.uint8)
    bits[trained_from:] = TRAINED
    bits[0] |= DOC_START
    return ids, bits


def test_packed_documents_are_trained_as_if_alone():
    """Two documents packed into one window (positions restart, attention stays within each):
    the packed loss equals the token-weighted loss of each document alone (1e-6); changing
    document 1's tokens leaves document 2's logits unchanged; no label crosses the boundary."""
    model = _model()
    # Document 2 trains every token, its first too (as text does): only the boundary keeps it out.
    (ids1, bits1), (ids2, bits2) = _document(20, 10, seed=1), _document(31, 0, seed=2)
    packed = to_batch(np.concatenate([ids1, ids2])[None], EOS, np.concatenate([bits1, bits2])[None])
    alone = [to_batch(ids[None], EOS, bits[None]) for ids, bits in ((ids1, bits1), (ids2, bits2))]
    assert packed.positions[0].tolist() == [*range(20), *range(30)]
    assert not packed.loss_mask[0, 19]  # document 1's EOS predicting document 2's first token
    assert trained_tokens(packed) == sum(trained_tokens(b) for b in alone) == 10 + 30
    with torch.no_grad():
        packed_loss = masked_loss_sum(model, packed) / trained_tokens(packed)
        alone_loss = sum(masked_loss_sum(model, b) for b in alone) / sum(trained_tokens(b) for b in alone)
        assert abs(packed_loss.item() - alone_loss.item()) < 1e-6

        perturbed = np.concatenate([np.random.default_rng(3).integers(0, EOS, 20), ids2])
        other = to_batch(perturbed[None], EOS, np.concatenate([bits1, bits2])[None])
        logits, other_logits = (model(b.inputs, b.positions) for b in (packed, other))
        assert torch.equal(logits[:, 20:], other_logits[:, 20:])
        assert not torch.allclose(logits[:, :20], other_logits[:, :20])
