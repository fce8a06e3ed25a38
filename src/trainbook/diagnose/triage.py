"""NaN and loss-spike triage: a bad step is caught before its update, re-run once with every
module watched, written up in `incidents/step-N/`, and met by the recipe's `[triage]` policy.

1. Judge (`Triage.judge`, called by train_step between the gradient norm and the update, on
   every rank): the loss and gradient norm are global values (reduced over every rank), so every
   rank computes the same verdict; one MAX all-reduce of its code makes it certain, so no rank
   ever updates while another skips. Bad: a non-finite loss or gradient norm, or a loss `spike_z`
   robust sigmas above the trend of the last `window` good steps (the `loss_spike` alert's
   Theil-Sen/MAD rule, monitor/alerts.py), judged once the LR warmup is over and a window of good
   steps has passed. A rejected step's gradients are dropped: the weights are as before it.
2. Re-run the step once, on the same micro-batches (kept by `StepBatches`) and the same weights,
   with a forward hook on every module (`Locator`): the first module, in the order modules finish
   their forward, whose output holds a NaN/inf is named, or failing that the first whose output
   gradient does in backward. A clean re-run means a transient fault (a flipped bit, a race): the
   re-run's update is applied and training goes on. The same verdict again: reproducible, the data
   or the model is the cause, and the policy decides.
3. `incidents/step-N/`: `incident.json` (the step's loss, gradient norm, LR, loss scale, the
   spike's z and trend, the re-run's numbers, the located module, per-block gradient norms of the
   re-run, the action), `batch-dp<R>.json` per data-parallel rank (every row's token ids as
   trained, its source, sample and token offset, whether the ids are the source's, the decoded
   row and the document(s) it was cut from) and `verdict.txt`, the one line the user sees.
4. The policy: `stop` (exit 5 with the verdict), `skip` (the step's data is spent, no update),
   `rollback` (the newest checkpoint at least `rollback_steps_back` steps back is loaded and the
   `rollback_skip_batches` batches after it are never read: `rollback` event in events.jsonl,
   which a later resume from that checkpoint applies again).
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainbook.atomic import atomic_write_json, atomic_write_text
from trainbook.config import TriageConfig
from trainbook.data import Prepared
from trainbook.data.loader import TrainLoader
from trainbook.data.samples import Batch
from trainbook.data.provenance import batch_rows, document_span
from trainbook.diagnose.blocks import block_of, block_order, squared_norm, unwrapped
from trainbook.monitor.alerts import robust_z
from trainbook.parallel.runtime import Runtime
from trainbook.runs import RunPaths

KINDS = (None, "spike", "nonfinite")  # verdict codes, worst last: ranks agree on the maximum


@dataclass(frozen=True)
class Verdict:
    kind: str
    """"nonfinite" or "spike"."""
    what: str
    """What was seen, in words: "loss is nan", "loss 7.3102 is 41.2 robust sigmas above ..."."""
    z: float | None = None
    expected: float | None = None


class SpikeRule:
    """The loss's recent trend: good steps only, after the LR warmup (as the loss_spike alert)."""

    def __init__(self, z: float, window: int):
        self.z = z
        self.history: deque[float] = deque(maxlen=window)
        self._last_lr: float | None = None
        self._warm = 0  # good steps seen since the LR stopped rising

    def check(self, loss: float, lr: float) -> Verdict | None:
        rising = self._last_lr is not None and lr > self._last_lr
        if rising or self._warm < self.history.maxlen:
            return None
        z, expected = robust_z(loss, self.history)
        if z <= self.z:
            return None
        return Verdict("spike", f"loss {loss:.4f} is {z:.1f} robust sigmas above its trend {expected:.4f} over "
                                f"the last {len(self.history)} steps", z=z, expected=expected)

    def accept(self, loss: float, lr: float) -> None:
        """A good step: part of the trend from now on (warmup steps are no yardstick)."""
        rising = self._last_lr is None or lr > self._last_lr
        self._last_lr = lr
        if rising and self._warm == 0:
            self.history.clear()
        else:
            self._warm += 1
        self.history.append(loss)


class StepBatches:
    """Passes the step's micro-batches through and keeps them (with where the loader read each),
    so the step can be re-run on exactly what it trained on. `begin()` at each step's start."""

    def __init__(self, batches: Iterator[Batch], loader: TrainLoader):
        self.batches = batches
        self.loader = loader
        self.taken: list[tuple[int, Batch]] = []  # (global sample the read started at, batch)

    def begin(self) -> None:
        self.taken = []

    def __iter__(self) -> StepBatches:
        return self

    def __next__(self) -> Batch:
        batch = next(self.batches)
        self.taken.append((self.loader.last_base, batch))
        return batch

    def replay(self, locator: Locator) -> Iterator[Batch]:
        """The step's batches again, telling `locator` which micro-batch runs."""
        for i, (_, batch) in enumerate(self.taken):
            locator.micro = i
            yield batch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(_local(t).detach()).all())


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


def module_path(name: str) -> str:
    """A module's name in the model as written (wrappers' name parts dropped)."""
    return ".".join(unwrapped(name)) or "(model)"


class Locator:
    """While entered: a forward hook on every module of `model` checks its output, and a tensor
    hook on that output checks the gradient flowing back into it; the first of each to hold a
    NaN/inf is kept as (micro-batch, order, module). Only training forwards count (`active`)."""

    def __init__(self, model: nn.Module, active: Callable[[], bool]):
        self.model = model
        self.active = active
        self.micro = 0
        self.forward: tuple[int, int, str] | None = None
        self.backward: tuple[int, int, str] | None = None
        self._seen = 0
        self._hooks: list = []

    def __enter__(self) -> Locator:
        for name, module in self.model.named_modules():
            if name:  # every module but the whole model (whose output is the head's)
                self._hooks.append(module.register_forward_hook(self._hook(module_path(name))))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, name: str) -> Callable:
        @torch.compiler.disable  # eager under train.compile: observing compiles nothing
        def hook(module, args, output):
            if not self.active():
                return
            self._seen += 1
            tensors = _tensors(output)
            if self.forward is None and not all(_finite(t) for t in tensors):
                self.forward = (self.micro, self._seen, name)
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name, self.micro))
        return hook

    def _grad_hook(self, name: str, micro: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self._seen += 1
            if self.backward is None and not _finite(grad):
                self.backward = (micro, self._seen, name)
        return hook


@dataclass
class Located:
    """The first non-finite module over all ranks: (module, micro-batch, ranks that saw it there)."""

    forward: tuple[str, int, list[int]] | None = None
    backward: tuple[str, int, list[int]] | None = None

    def describe(self, micro_batches: int) -> str:
        if self.forward is not None:
            name, micro, ranks = self.forward
            return (f"first non-finite output: {name} (micro-batch {micro + 1} of {micro_batches}, "
                    f"{_ranks(ranks)})")
        if self.backward is not None:
            name, micro, ranks = self.backward
            return (f"outputs finite; first non-finite gradient flows back into {name}'s output "
                    f"(micro-batch {micro + 1} of {micro_batches}, {_ranks(ranks)})")
        return "every module output and gradient is finite"


def _ranks(ranks: list[int]) -> str:
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(map(str, ranks))


@dataclass
class Outcome:
    """What triage made of a bad step: `action` is "continue" (transient: the re-run's update was
    applied), "skip", "stop" or "rollback" (to `rollback_to`); `line` is the verdict the user
    sees, `event` the incident event's fields, `rerun` the re-run's StepResult."""

    action: str
    line: str
    event: dict
    rerun: object
    rollback_to: Path | None = None


class Triage:
    def __init__(self, cfg: TriageConfig, rt: Runtime, paths: RunPaths, data: Prepared, loader: TrainLoader,
                 samples_per_step: int):
        """`paths`: the run's; incidents go into its `incidents/`, rollbacks look in its `checkpoints/`."""
        self.cfg = cfg
        self.rt = rt
        self.paths = paths
        self.data = data
        self.loader = loader
        self.samples_per_step = samples_per_step
        self.spikes = SpikeRule(cfg.spike_z, cfg.window) if cfg.on_spike != "ignore" else None
        self.rollbacks = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.on_nonfinite != "ignore" or self.spikes is not None

    # ---- judge (every rank, every step) ------------------------------------------------------

    def judge(self, loss: float, grad_norm: float, lr: float) -> Verdict | None:
        """The step's verdict, the same on every rank; None: the update goes ahead."""
        verdict = None
        if self.cfg.on_nonfinite != "ignore" and not math.isfinite(loss):
            verdict = Verdict("nonfinite", f"loss is {loss}")
        elif self.cfg.on_nonfinite != "ignore" and not math.isfinite(grad_norm):
            verdict = Verdict("nonfinite", f"gradient norm is {grad_norm} (loss {loss:.4f})")
        elif self.spikes is not None and math.isfinite(loss):
            verdict = self.spikes.check(loss, lr)
        if not self.rt.distributed:
            return verdict
        code = torch.tensor([KINDS.index(verdict.kind if verdict else None)], device=self.rt.device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
        agreed = KINDS[int(code.item())]
        if agreed == (verdict.kind if verdict else None):
            return verdict
        return None if agreed is None else Verdict(agreed, f"another rank judged the step {agreed}")

    def accept(self, loss: float, lr: float) -> None:
        if self.spikes is not None and math.isfinite(loss):
            self.spikes.accept(loss, lr)

    def policy(self, verdict: Verdict) -> str:
        return self.cfg.on_nonfinite if verdict.kind == "nonfinite" else self.cfg.on_spike

    # ---- after a bad step (every rank together) -------------------------------------------------

    def handle(self, step: int, first, lr: float, batches: StepBatches, model: nn.Module,
               active: Callable[[], bool], rerun: Callable[[Iterator[Batch], Callable[[], None]], object],
               wait_for_saves: Callable[[], None]) -> Outcome:
        """Step `step` was rejected (`first`: its StepResult): re-run it on the same batches and
        weights with every module watched (`rerun(batches, observe_grads)` runs train_step), write
        the incident and decide what the policy does. Every rank, together."""
        verdict = first.rejected
        observe = self.block_grad_norms(model)
        with Locator(model, active) as locator:
            again = rerun(batches.replay(locator), observe)
        reproducible = again.rejected is not None
        located = self.locate(locator).describe(len(batches.taken))
        action = self.policy(verdict) if reproducible else "continue"
        target, why = None, ""
        if action == "rollback":
            wait_for_saves()
            target = self.rollback_target(step)
            if self.rollbacks >= self.cfg.max_rollbacks:
                action, why = "stop", f" (triage.max_rollbacks = {self.cfg.max_rollbacks} reached)"
            elif target is None:
                action, why = "stop", " (no checkpoint to roll back to)"
        batch = self.batch_record(batches)
        changed = sum(not row["matches_source"] for row in batch["rows"])
        if changed:  # what the loader read is not what the step trained on
            located += (f"; {changed} of {len(batch['rows'])} rows of batch-dp{self.rt.dp_rank}.json differ from "
                        "their source's tokens")
        said = {"continue": "the re-run's update was applied", "skip": "step skipped, weights unchanged",
                "stop": "training stopped" + why,
                "rollback": f"rolled back to checkpoint {target.name if target else ''} and skipping the "
                            f"{self.cfg.rollback_skip_batches} batches of data after it"}[action]
        rerun_said = (f"reproducible: the re-run gave loss {again.loss:.4g}, grad norm {again.grad_norm:.4g}"
                      if reproducible else
                      f"transient: the re-run was clean (loss {again.loss:.4f}, grad norm {again.grad_norm:.4g})")
        where = self.paths.name(self.paths.incidents / f"step-{step}")
        line = "; ".join([f"step {step}: {verdict.what}", *([located] if reproducible else []), rerun_said, said,
                          f"incident in {where}/"])
        self.write_incident(step, verdict, {
            "loss": first.loss, "grad_norm": first.grad_norm, "lr": lr, "loss_scale": first.loss_scale,
            "micro_batches": len(batches.taken),
            "rerun": {"loss": again.loss, "grad_norm": again.grad_norm, "reproducible": reproducible},
            "located": located, "block_grad_norms": self.grad_norms, "policy": self.policy(verdict),
            "action": action, "rollback_to": target.name if target else None, "verdict": line,
        }, batch)
        event = {"problem": verdict.kind, "what": verdict.what, "located": located, "reproducible": reproducible,
                 "action": action, "dir": where}
        return Outcome(action, line, event, again, target)

    def locate(self, locator: Locator) -> Located:
        """Every rank's first non-finite module, the earliest kept (pipeline stages in order)."""
        mine = {"pp": self.rt.pp_rank if self.rt.distributed else 0, "forward": locator.forward,
                "backward": locator.backward}
        parts = [mine]
        if self.rt.distributed:
            parts = [None] * self.rt.world_size
            dist.all_gather_object(parts, mine)
        located = Located()
        for key in ("forward", "backward"):
            found = [(p["pp"], p[key][0], p[key][1], p[key][2], r) for r, p in enumerate(parts) if p[key]]
            if found:
                first = min(found)
                ranks = [r for pp, micro, _, name, r in found if (name, micro) == (first[3], first[1])]
                setattr(located, key, (first[3], first[1], ranks))
        return located

    def block_grad_norms(self, model: nn.Module) -> Callable[[], None]:
        """An `observe_grads` for the re-run: fills `self.grad_norms` (block -> global L2 norm)."""
        def observe() -> None:
            sums: dict[str, float] = {}
            params = [(block_of(n), p) for n, p in model.named_parameters() if p.requires_grad]
            squares = torch.stack([squared_norm(p.grad, self.rt.device) for _, p in params]).tolist() if params else []
            for (block, _), sq in zip(params, squares):
                sums[block] = sums.get(block, 0.0) + sq
            # One rank per pipeline stage speaks for it (the others, tp and cp ranks included, hold
            # the same global sums).
            coord = self.rt.dims.coordinate(self.rt.rank)
            mine = {"speaks": self.rt.dp_rank == 0 and coord["tp"] == 0 and coord["cp"] == 0, "sums": sums}
            parts = [mine]
            if self.rt.distributed:
                parts = [None] * self.rt.world_size
                dist.all_gather_object(parts, mine)
            merged: dict[str, float] = {}
            for part in parts:
                if part["speaks"]:
                    for block, sq in part["sums"].items():
                        merged[block] = merged.get(block, 0.0) + sq
            self.grad_norms = {b: math.sqrt(v) for b, v in sorted(merged.items(), key=lambda kv: block_order(kv[0]))}
        self.grad_norms: dict[str, float] = {}
        return observe

    def rollback_target(self, bad_step: int) -> Path | None:
        """The checkpoint to roll back to (rank 0 looks, every rank gets its answer)."""
        from trainbook.checkpoint.read import newest_valid

        limit = bad_step - max(self.cfg.rollback_steps_back, 1)
        found = self.rt.rank0_first(lambda: newest_valid(self.paths.checkpoints, lambda *_: None, at_most=limit))
        return None if found is None else Path(found[0])

    def write_incident(self, step: int, verdict: Verdict, facts: dict, batch: dict) -> Path:
        """incidents/step-N/: incident.json and verdict.txt (rank 0), each data-parallel rank's
        batch-dp<R>.json (`batch_record`, written by the first rank of each replica)."""
        where = self.paths.incidents / f"step-{step}"
        where.mkdir(parents=True, exist_ok=True)
        coord = self.rt.dims.coordinate(self.rt.rank)
        if coord["tp"] == 0 and coord["cp"] == 0 and self.rt.pp_rank == 0:  # one rank per replica
            atomic_write_json(where / f"batch-dp{self.rt.dp_rank}.json", batch)
        if self.rt.is_main:
            atomic_write_json(where / "incident.json", {"step": step, "kind": verdict.kind, "what": verdict.what,
                                                       "z": verdict.z, "trend": verdict.expected, **facts}, indent=2)
            atomic_write_text(where / "verdict.txt", facts["verdict"] + "\n")
        return where

    def batch_record(self, batches: StepBatches) -> dict:
        """This rank's rows of the step: as trained, where they came from, and their documents."""
        tok, eos = self.data.tokenizer, self.data.tokenizer.eos_id
        rows = []
        for micro, (base, batch) in enumerate(batches.taken):
            trained = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1).cpu().numpy()  # (B, T+1)
            for j, (source, sample, offset) in enumerate(batch_rows(self.loader, base)):
                stream = self.data.train[source]
                length = trained.shape[1]
                own = stream.take(np.array([offset]), length)[0]
                first, last, cut = document_span(stream, offset, offset + length, eos)
                document = stream.take(np.array([first]), last - first)[0]
                rows.append({
                    "micro_batch": micro + 1, "row": j, "source": source, "sample": sample, "token_offset": offset,
                    "matches_source": bool(np.array_equal(own, trained[j])),
                    "token_ids": trained[j].tolist(), "text": tok.decode(trained[j].tolist()),
                    "document": {"token_start": first, "token_end": last, "cut": cut,
                                 "text": tok.decode(int(t) for t in document if t != eos)},
                })
        return {"dp_rank": self.rt.dp_rank, "global_samples_from": batches.taken[0][0] if batches.taken else None,
                "rows": rows}


def skipped_windows(events_path: Path) -> list[tuple[int, int]]:
    """The windows of global samples the run's rollbacks skipped, from its events.jsonl."""
    if not events_path.is_file():
        return []
    windows = []
    for line in events_path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if event.get("kind") == "rollback":
            windows.append(tuple(event["skipped_samples"]))
    return windows
