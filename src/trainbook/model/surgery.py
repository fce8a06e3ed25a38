"""Fine-tuning surgery on a built model: vocabulary resize, re-initialisation, freezing.

Applied after the weights are loaded and before any parallelism, in that order: resize (new
rows), reinit (patterns), freeze (patterns). Patterns are `fnmatch` globs over parameter names
as `named_parameters()` spells them (`tok_embeddings.weight`, `layers.3.attention.wq.weight`, ...).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from trainbook.model.llama import Llama
from trainbook.model.lora import describe


def matching(model: nn.Module, patterns: list[str]) -> tuple[list[str], list[str]]:
    """(parameter names matched by any pattern, patterns that matched nothing)."""
    names = [name for name, _ in model.named_parameters()]
    matched = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    return matched, unmatched


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Stop the matching parameters from training; returns the patterns that matched nothing."""
    matched, unmatched = matching(model, patterns)
    params = dict(model.named_parameters())
    for name in matched:
        params[name].requires_grad_(False)
    return unmatched


@torch.no_grad()
def reinit(model: nn.Module, patterns: list[str], std: float, seed: int) -> list[str]:
    """Fresh values for the matching parameters: norm gains 1, matrices normal(0, std)."""
    matched, unmatched = matching(model, patterns)
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(seed)
    for name in matched:
        p = params[name]
        if p.ndim < 2:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=generator) * std)
    return unmatched


@torch.no_grad()
def resize_vocab(model: Llama, vocab_size: int, how: str, seed: int) -> None:
    """Grow the embedding (and an untied output head) to `vocab_size` rows.

    New rows are the mean of the existing ones (`mean`: a new token starts as an average token,
    which keeps the output distribution of the imported model nearly unchanged), or normal(0,
    init_std). Existing rows keep their values.
    """
    old = model.tok_embeddings.weight
    n_old = old.shape[0]
    if vocab_size == n_old:
        return
    generator = torch.Generator().manual_seed(seed)

    def grown(weight: torch.Tensor) -> nn.Parameter:
        extra = vocab_size - n_old
        if how == "mean":
            rows = weight.mean(dim=0, keepdim=True).expand(extra, -1)
        else:
            rows = torch.randn(extra, weight.shape[1], generator=generator) * model.cfg.init_std
        return nn.Parameter(torch.cat([weight, rows.to(weight.dtype)]))

    tied = model.output.weight is old
    model.tok_embeddings.weight = grown(old)
    model.tok_embeddings.num_embeddings = vocab_size
    if tied:
        model.output.weight = model.tok_embeddings.weight
    else:
        model.output.weight = grown(model.output.weight)
    model.output.out_features = vocab_size
    model.cfg = model.cfg.model_copy(update={"vocab_size": vocab_size})


def trainable_summary(model: nn.Module) -> str:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = describe(model)
    return f"{trainable:,} of {total:,} parameters trainable ({trainable / total:.1%})" + (f": {lora}" if lora else "")
