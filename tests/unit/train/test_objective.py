"""The step's seams, on a real model: the observer meets the step at its points in order, and an
objective other than next-token plugs in without the step or the loop knowing (here the shape
supervised fine-tuning will take: a loss mask, normalised by the trained tokens of the whole
step, the count reported)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from trainbook.config.model import ModelConfig
from trainbook.data.loader import Batch
from trainbook.model import build_model, resolve
from trainbook.phase import PhaseTracker
from trainbook.precision import Precision
from trainbook.config import PrecisionConfig
from trainbook.train.engine import LocalEngine
from trainbook.train.objective import MicroLoss, NextTokenLoss
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
