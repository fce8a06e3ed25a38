"""AdamW with parameter groups: weight decay on matrices, none on norms and embeddings."""

from __future__ import annotations

import torch
from torch import nn

from trainbook.config import OptimConfig


def param_groups(model: nn.Module, decay_all: bool, embeddings: tuple = ()) -> list[dict]:
    """Split trainable parameters by role, found from module types, never from names (and by
    mesh, for sharded ones).

    `embeddings`: parameters that are embeddings without an nn.Embedding module around them (a
    pipeline's last-stage copy of a tied embedding is the output head's weight).
    """
    no_decay_ids = set()
    if not decay_all:
        no_decay_ids.update(id(p) for p in embeddings)
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
        # Norm weights, biases, gains: every vector.
        no_decay_ids.update(id(p) for p in model.parameters() if p.ndim < 2)
    groups: dict[tuple, dict] = {}
    for p in model.parameters():  # tied weights appear once
        if p.requires_grad:
            # One group per mesh too: AdamW's foreach kernels run a group's tensors together, and a
            # DTensor op takes tensors of one mesh (expert parallelism's experts have their own).
            decay = id(p) not in no_decay_ids
            key = (decay, getattr(p, "device_mesh", None))
            groups.setdefault(key, {"params": [], "use_decay": decay})["params"].append(p)
    ordered = sorted(groups.items(), key=lambda kv: not kv[0][0])  # decay first, then by first appearance
    return [g for _, g in ordered]


def build_optimizer(model: nn.Module, cfg: OptimConfig, embeddings: tuple = ()) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.decay_norms_and_embeddings, embeddings)
    for group in groups:
        group["weight_decay"] = cfg.weight_decay if group.pop("use_decay") else 0.0
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    aliases: dict[str, str] | None = None) -> dict[str, dict]:
    """Per-parameter optimizer state keyed by parameter name, tensors only.

    Hyperparameters are not saved: they come from the recipe (and the LR from the schedule).
    Tensors-only state means a checkpoint never needs unpickling to load.
    """
    return {name: dict(optimizer.state[p]) for name, p in _named(model, aliases) if p in optimizer.state}


def _named(model: nn.Module, aliases: dict[str, str] | None):
    """(name the state is kept under, parameter). `aliases` renames a parameter's state: a
    pipeline stage's copy of a tied embedding keeps its state under the embedding's name, as the
    single-device model (where both are one parameter) does."""
    aliases = aliases or {}
    return [(aliases.get(name, name), p) for name, p in model.named_parameters()]


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, dict],
                         aliases: dict[str, str] | None = None) -> None:
    for name, p in _named(model, aliases):
        if name in state:
            optimizer.state[p] = {key: value.clone() for key, value in state[name].items()}


def optimizer_state_like(model: nn.Module, entries: dict, prefix: str = "optim.",
                         aliases: dict[str, str] | None = None) -> dict[str, dict]:
    """Empty tensors shaped like the optimizer state a checkpoint holds, for DCP to load into.

    `entries` is the checkpoint's flat key -> tensor metadata. A tensor with the parameter's
    (global) shape is allocated like the parameter, so a sharded parameter gets a sharded state.
    """
    state: dict[str, dict] = {}
    for name, p in _named(model, aliases):
        head = f"{prefix}{name}."
        for key, meta in entries.items():
            if key.startswith(head) and "." not in key[len(head):]:
                dtype = meta.properties.dtype
                like = (torch.zeros_like(p, dtype=dtype) if tuple(meta.size) == tuple(p.shape)
                        else torch.zeros(tuple(meta.size), dtype=dtype))
                state.setdefault(name, {})[key[len(head):]] = like
    return state
