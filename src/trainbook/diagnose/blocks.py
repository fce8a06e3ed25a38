"""Transformer blocks by name, as per-layer statistics, NaN triage and the OOM breakdown report
them: which block a parameter or module belongs to, the order blocks are listed in, and the
squared norms block norms are summed from.

model/llama.py keeps its blocks in `layers` (an `nn.ModuleDict` keyed "0".."N-1"). The wrappers
parallel/ applies from outside (torch.compile, activation checkpointing, FSDP, DDP) may add parts
of their own to the names (`WRAPPERS`); a block's name ignores them.
"""

from __future__ import annotations

import re

import torch

WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module")
_BLOCK = re.compile(r"(?:^|\.)(layers\.\d+)(?:\.|$)")
_BLOCK_MODULE = re.compile(r"(?:.*\.)?layers\.(\d+)")


def unwrapped(name: str) -> list[str]:
    """The parts of a parameter or module name, wrappers' parts dropped."""
    return [p for p in name.split(".") if p not in WRAPPERS]


def block_of(name: str) -> str:
    """The block a parameter (or module) name belongs to, wrappers' name parts ignored."""
    parts = unwrapped(name)
    match = _BLOCK.search(".".join(parts))
    if match:
        return match.group(1)
    if "tok_embeddings" in parts:
        return "embed"
    if "output" in parts:
        return "output"
    if "norm" in parts:
        return "norm"
    return parts[0] if parts else name


def block_index(name: str) -> int | None:
    """i when module name `name` is transformer block i itself (the outermost module whose name
    ends in `layers.<i>`, wrappers of the whole model before it allowed); None for a module inside
    a block (a wrapped block's inner module among them) or outside any."""
    match = _BLOCK_MODULE.fullmatch(name)
    return int(match.group(1)) if match else None


def block_order(name: str) -> tuple:
    """Sort key of block names: "embed", then "layers.<i>" by i, then "norm", then the rest by name."""
    if name == "embed":
        return (0, 0)
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]))
    return (2, name != "norm", name)


def squared_norm(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The squared L2 norm of a whole tensor (float64, 0-d): a DTensor's over all its shards, by
    DTensor's own reduction, which knows its placements (a 2-D FSDP x TP weight's, or the
    Replicate-labelled gradient torch gives a tensor-parallel embedding), as clipping takes it."""
    if t is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    if hasattr(t, "full_tensor"):
        return torch.linalg.vector_norm(t, dtype=torch.float64).full_tensor().square()
    return t.double().square().sum()
