"""The one count of a model's parameters and FLOPs, read off the model built on the meta device.

Every figure that depends on the architecture (the parameter count a run logs, `plan`'s bytes per
rank, MFU's FLOPs per token, the OOM breakdown) comes from here, so a new option of the decoder
(biases, q/k norms, a head_dim that is not dim / n_heads, experts) is counted by building it, not
by a formula someone has to remember to change.

FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B): 6 N for the matrix multiplies of
forward and backward, N the weights of every `nn.Linear` (each projection and the output head,
even when tied to the embedding; not the embedding lookup, norms or biases), plus 12 x T x the sum
over layers of the query width (n_heads x head_dim) for attention's two matmuls over the full
T x T square, as torchtitan counts it though the causal mask skips half (multi-head latent
attention's two matmuls differ in width: their mean, `LatentAttention.attention_width`).

A module that routes tokens to a few of its parameters (a mixture of experts) says so by
defining `active_numel()`, the parameters one token passes through; the count then takes that for
the module's share of `active` and of the matmul weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from trainbook.config.model import ModelConfig
from trainbook.model.registry import is_resolved, resolve


@dataclass(frozen=True)
class ModelCount:
    total: int
    """Parameters, a tied matrix counted once."""
    embedding: int
    """The token embedding table's (with tied weights, the head's matrix too)."""
    active: int
    """Parameters one token passes through: `total` for a dense model."""
    matmul: int
    """Weights one token multiplies, forward: every projection and the output head."""
    attention_width: int
    """The query width (n_heads x head_dim) summed over layers: attention's FLOPs per position."""
    block_sharded: int
    """Per block (the largest): the elements tensor parallel splits (projection weights and biases;
    a mixture's expert weights)."""
    block_replicated: int
    """Per block (the largest): the elements every tp rank holds whole (norm gains, q/k norms)."""

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
        return 6 * self.matmul + 12 * self.attention_width * seq_len


def count(cfg: ModelConfig) -> ModelCount:
    """The count of model `cfg` (resolved or not), from the model built on the meta device."""
    return _count(cfg if is_resolved(cfg) else resolve(cfg))


@functools.lru_cache(maxsize=64)
def _count(cfg: ModelConfig) -> ModelCount:
    from trainbook.model.llama import build_model  # the model module imports this one's users

    model = build_model(cfg, "meta", seed=0)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    matmul, active_less = _matmul_and_routed(model)
    widths = sum(block.attention.attention_width for block in model.layers.values())
    # The largest block (a mixture of experts' layer outweighs its dense ones): its expert weights
    # count as sharded, which tensor parallel never has to split (it is refused for experts).
    block = max(model.layers.values(), key=lambda b: sum(p.numel() for p in b.parameters()))
    sharded = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                  for m in block.modules() if isinstance(m, nn.Linear))
    sharded += sum(p.numel() for name, p in block.named_parameters() if ".experts." in f".{name}")
    replicated = sum(p.numel() for p in block.parameters()) - sharded
    return ModelCount(total=total, embedding=embedding, active=total - active_less, matmul=matmul,
                      attention_width=widths, block_sharded=sharded, block_replicated=replicated)


def _matmul_and_routed(model: nn.Module) -> tuple[int, int]:
    """(matmul weights per token, parameters a token skips) over `model`'s modules."""
    matmul = skipped = 0
    routed: list[str] = []  # modules counted by their own active_numel, with everything inside
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in routed):
            continue
        if hasattr(module, "active_numel"):
            active = module.active_numel()
            skipped += sum(p.numel() for p in module.parameters()) - active
            matmul += active
            routed.append(name)
        elif isinstance(module, nn.Linear):
            matmul += module.weight.numel()
    return matmul, skipped


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token of model `cfg` at `seq_len` (`ModelCount.flops_per_token`)."""
    return count(cfg).flops_per_token(seq_len)


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameter count of a built model, a tied matrix counted once. `exclude_embeddings` drops the
    token embedding table (a lookup, not a matmul; with tied weights that is the head's matrix too)."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings and getattr(model, "tok_embeddings", None) is not None:
        total -= model.tok_embeddings.weight.numel()
    return total
