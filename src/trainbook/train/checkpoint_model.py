"""A model holding a trainbook checkpoint's weights, built the one way that `trainbook sample`,
`trainbook eval` and `model.init_from = "run:PATH"` share.

The model is built from the run's own `config.resolved.toml` (its [model] and [lora] sections),
so a checkpoint is always read into the architecture that wrote it. A LoRA run's checkpoint holds
its adapters beside the frozen base: they are put on the model before loading (DCP would skip
their keys otherwise and the base alone would run), and `merge_lora` folds them into the base
weights (W + alpha/r B A) for a plain model that trains on as any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainbook.checkpoint import load_state, locate, step_of
from trainbook.config import Config, ModelConfig, load_config
from trainbook.model import build_model
from trainbook.model.lora import apply_lora, merged_state_dict
from trainbook.runs import RunPaths


@dataclass(frozen=True)
class Trained:
    run_dir: Path
    checkpoint: Path
    cfg: Config
    """The run's resolved config (`config.resolved.toml`)."""
    model: nn.Module

    @property
    def step(self) -> int | None:
        return step_of(self.checkpoint)


def locate_run(target: Path) -> tuple[Path, Path, Config]:
    """(run directory, checkpoint, the run's resolved config) of a run directory (its newest valid
    checkpoint) or a checkpoint directory; a one-line error when there is none."""
    run_dir, ckpt = locate(target)
    return run_dir, ckpt, load_config(RunPaths.of(run_dir).config)


def load_trained(target: Path, device: torch.device | str = "cpu", *, merge_lora: bool = False) -> Trained:
    """The model of `target` (a run directory or a checkpoint) with the checkpoint's weights on
    `device`; a LoRA run's adapters applied (kept apart, or merged with `merge_lora`)."""
    run_dir, ckpt, cfg = locate_run(target)
    return Trained(run_dir, ckpt, cfg, read_model(ckpt, cfg, device, merge_lora=merge_lora))


def read_model(ckpt: Path, cfg: Config, device: torch.device | str, *, merge_lora: bool = False,
               model_cfg: ModelConfig | None = None) -> nn.Module:
    """A model with checkpoint `ckpt`'s weights, `cfg` being the resolved config of the run that
    wrote it. `model_cfg`: build this model section instead of the run's (the same shapes: a
    longer RoPE table, another init_std)."""
    arch = model_cfg or cfg.model
    model = build_model(arch, device, seed=cfg.run.seed)
    apply_lora(model, cfg.lora, seed=0)  # the adapters' values come from the checkpoint
    state = {"model": model.state_dict()}
    load_state(ckpt, state)
    model.load_state_dict(state["model"])
    if merge_lora and cfg.lora.enabled:
        merged = merged_state_dict(model.state_dict(), cfg.lora.alpha / cfg.lora.rank)
        model = build_model(arch, device, seed=cfg.run.seed)
        model.load_state_dict(merged)
    return model
