"""The phase tracker: what a rank is doing, read from another thread while a real step runs."""

import threading

import torch

from trainbook.config import ModelConfig, PrecisionConfig
from trainbook.data.samples import Batch
from trainbook.model import build_model, resolve
from trainbook.phase import Phase, PhaseTracker
from trainbook.precision import Precision
from trainbook.train.engine import LocalEngine
from trainbook.train.step import Step

CPU = torch.device("cpu")


def test_another_thread_sees_the_step_and_phase_a_real_step_is_in():
    model = build_model(resolve(ModelConfig(name="debug")), CPU, seed=0)
    precision = Precision(PrecisionConfig(), CPU)
    engine = LocalEngine.one_process(model, precision)
    tracker = engine.tracker
    seen, reached, read = [], threading.Event(), threading.Event()

    def watcher():  # the hang watchdog's view: it only reads
        reached.wait()
        seen.append(tracker.current())
        read.set()

    def in_forward(module, args):  # stop the step inside the last block's forward until read
        reached.set()
        assert read.wait(timeout=60)

    handle = model.layers[str(len(model.layers) - 1)].register_forward_pre_hook(in_forward)
    thread = threading.Thread(target=watcher)
    thread.start()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    batches = iter([Batch(tokens[:, :-1], tokens[:, 1:], None)])
    tracker.begin_step(7)
    result = Step.next_token(engine, torch.optim.AdamW(model.parameters()), 1, 1.0,
                             precision.loss_scaler(), tracker)(batches)
    thread.join()
    handle.remove()

    assert seen[0].phase is Phase.FORWARD and seen[0].step == 7
    assert result.phases.keys() == {"data", "forward", "backward", "grad_sync", "optimizer", "checkpoint", "eval"}
    assert all(seconds >= 0 for seconds in result.phases.values())
    now = tracker.current()
    # The update is the step's last part: the loss report comes before it (triage judges the
    # step's global loss and gradient norm before any weight changes).
    assert now.phase is Phase.OPTIMIZER and now.step == 7


def test_durations_add_up_per_phase_and_reset_when_taken():
    tracker = PhaseTracker()
    tracker.begin_step(1)
    tracker.enter(Phase.FORWARD)
    tracker.enter(Phase.BACKWARD)
    tracker.enter(Phase.FORWARD)
    first = tracker.take_durations()
    assert set(first) == {Phase.DATA, Phase.FORWARD, Phase.BACKWARD}
    assert set(tracker.take_durations()) <= {Phase.FORWARD}  # only the time since the last take
    assert tracker.current().phase is Phase.FORWARD and tracker.current().step == 1


def test_the_boundary_hook_sees_every_phase_change_before_the_clock_is_read():
    seen = []
    tracker = PhaseTracker(boundary=lambda phase, step, detail: seen.append((phase, tracker.current().phase)))
    tracker.begin_step(1)
    tracker.enter(Phase.FORWARD)
    tracker.enter(Phase.BACKWARD)
    tracker.take_durations()  # closes the running phase: the device is synchronised there too
    # Each call comes while the previous phase is still current: its queued work is still its own.
    assert seen == [(Phase.DATA, Phase.IDLE), (Phase.FORWARD, Phase.DATA), (Phase.BACKWARD, Phase.FORWARD),
                    (Phase.BACKWARD, Phase.BACKWARD)]
