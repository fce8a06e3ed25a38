"""The training state: where the run is, everything a checkpoint holds, and the resume from one.

A checkpoint holds tensors only, so loading never unpickles (checkpoint/metadata.py reads DCP's
metadata through an allow-list). The LR schedule is a pure function of the step, and the data
order a pure function of the seed and `data.consumed`; RNG states are kept per rank.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import trainbook
from trainbook.checkpoint import load_state, tensor_entries
from trainbook.config import Config, dump_toml, redact_tree
from trainbook.data import TrainLoader
from trainbook.diagnose.triage import skipped_windows
from trainbook.monitor.health import attempt
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.runtime import Runtime
from trainbook.precision import LossScaler
from trainbook.train.optim import load_optimizer_state, optimizer_state, optimizer_state_like
from trainbook.train.rng import rng_state, set_rng_state


class TrainState:
    """`step` and `tokens` (the run's counters) and the parts whose state a checkpoint keeps.
    `events_path`: where a rollback's skipped data windows are read back from on resume."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, aliases: dict[str, str],
                 loader: TrainLoader, scaler: LossScaler, rt: Runtime, events_path: Path, logger: logging.Logger):
        self.model, self.optimizer, self.aliases = model, optimizer, aliases
        self.loader, self.scaler, self.rt = loader, scaler, rt
        self.events_path, self.logger = events_path, logger
        self.step = 0
        self.tokens = 0
        self.outer = None
        """Delayed synchronisation's outer loop (parallel/local_sgd.py), or None: each replica's
        inner optimizer state is then kept per rank, and the outer momentum beside it."""

    def state_dict(self) -> dict:
        """Everything a checkpoint holds: tensors only."""
        return {
            "model": self.model.state_dict(),
            "optim": optimizer_state(self.model, self.optimizer, self.aliases),
            "trainer": {"step": torch.tensor(self.step), "tokens": torch.tensor(self.tokens)},
            "data": {k: torch.tensor(v) for k, v in self.loader.state_dict().items()},
            "rng": {f"rank{self.rt.rank}": rng_state()},
            "precision": self.scaler.state_dict(),
            **({"comm": {f"rank{self.rt.rank}": comm}} if (comm := self._compression_state()) else {}),
            **self._outer_state(),
        }

    def _outer_state(self) -> dict:
        if self.outer is None:
            return {}
        local = {"local": {f"rank{self.rt.rank}": {"optim": optimizer_state(self.model, self.optimizer, self.aliases)}}}
        return {**local, **({"outer": outer} if (outer := self.outer.state_dict()) else {})}

    def _compression_state(self) -> dict[str, torch.Tensor]:
        """This rank's PowerSGD state (parallel/compression.py), if the run compresses with it."""
        compression = getattr(self.model, "grad_compression", None)
        return compression.state_dict() if compression is not None else {}

    def load(self, path: Path) -> None:
        """Continue from checkpoint `path`: model, optimizer moments, counters, data position, RNG."""
        entries = tensor_entries(path)
        state = self.state_dict()  # model tensors are the parameters: DCP loads into them in place
        state["optim"] = optimizer_state_like(self.model, entries, aliases=self.aliases)
        rng_key = f"rank{self.rt.rank}"
        if f"rng.{rng_key}.torch_cpu" not in entries:  # a checkpoint from fewer ranks
            state.pop("rng")
            self.logger.warning(f"{path} has no RNG state for rank {self.rt.rank}; it keeps its seeded state")
        if "precision.scale" not in entries:  # a checkpoint from before loss scaling
            state.pop("precision")
        compression = getattr(self.model, "grad_compression", None)
        state.pop("comm", None)
        held = {key.removeprefix(f"comm.{rng_key}."): (list(meta.size), meta.properties.dtype)
                for key, meta in entries.items() if key.startswith(f"comm.{rng_key}.")}
        if compression is not None and held:
            state["comm"] = {rng_key: compression.state_like(held)}
        elif compression is not None and compression.powersgd is not None:
            self.logger.warning(f"{path} has no PowerSGD state for rank {self.rt.rank}: its error feedback "
                                "starts from zero")
        self._outer_like(path, state, entries, rng_key)
        load_state(path, state)
        if self.outer is not None:
            if "local" in state:
                state["optim"] = state["local"][rng_key]["optim"]
            self.outer.load_state_dict(state.get("outer", {}))
        if "comm" in state:
            compression.load_state_dict(state["comm"][rng_key])
        if "precision" in state:
            self.scaler.load_state_dict(state["precision"])
        load_optimizer_state(self.model, self.optimizer, state["optim"], self.aliases)
        self.step = int(state["trainer"]["step"])
        self.tokens = int(state["trainer"]["tokens"])
        self.loader.load_state_dict({k: int(v) for k, v in state["data"].items()})
        if "rng" in state:
            set_rng_state(state["rng"][rng_key])
        # The data windows this run's rollbacks skipped (events.jsonl) are never read again.
        for start, end in self.rt.rank0_first(lambda: skipped_windows(self.events_path)):
            self.loader.skip(start, end)

    def _outer_like(self, path: Path, state: dict, entries: dict, rank: str) -> None:
        """What to load of delayed synchronisation's state: this rank's inner optimizer moments
        (else rank 0's `optim`, said in the log) and the outer momentum."""
        state.pop("local", None)
        state.pop("outer", None)
        if self.outer is None:
            return
        mine = optimizer_state_like(self.model, entries, prefix=f"local.{rank}.optim.", aliases=self.aliases)
        if mine:
            state["local"] = {rank: {"optim": mine}}
        else:
            self.logger.warning(f"{path} has no inner optimizer state for rank {self.rt.rank}: it starts from rank 0's")
        keys = {key.removeprefix("outer.") for key in entries if key.startswith("outer.")}
        if keys:
            state["outer"] = self.outer.state_like(keys)

    def record_resume(self, path: Path, emit: Callable[..., None], message: Callable[[str], None], **facts) -> None:
        """Say in the log and events.jsonl (`emit`) where this run continues from, and what was skipped."""
        for bad, why in facts.get("skipped", []):
            self.logger.warning(f"skipped invalid checkpoint {bad}: {why}")
            emit("checkpoint_invalid", self.step, path=str(bad), reason=why)
        for key, (old, new) in facts.get("changed", {}).items():
            self.logger.warning(f"config changed since the checkpoint: {key} = {old!r} -> {new!r}")
        emit("resume", self.step, path=str(path), tokens=self.tokens, **process(), **{
            k: v for k, v in facts.items() if k != "skipped"})
        message(f"resumed from {path} at step {self.step}")


def process() -> dict:
    """Which process writes this attempt of the run: `trainbook runs` tells a live run by it."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "attempt": attempt()}


def checkpoint_description(cfg: Config, dims: ParallelDims) -> dict:
    """What every manifest says about the run that wrote it (compatibility checks read it)."""
    text = dump_toml(cfg)
    return {
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "config": redact_tree(cfg.model_dump(mode="json")),  # secrets as fingerprints
        "parallel": dims.sizes(),
        "versions": {"trainbook": trainbook.__version__, "torch": torch.__version__},
    }
