"""The arithmetic of reinforcement learning and preference optimisation, as plain functions of
tensors: group advantages, the clipped policy loss with its KL term and its aggregations, token
log-probabilities and entropies, and the DPO loss. The objectives (train/grpo.py) call them; the
tests check each against a hand computation (tests/unit/train/test_rl.py).

Names follow the papers and TRL, whose users read these numbers:
- GRPO (Shao et al. 2024): a group of G completions per prompt; advantage A_i = (r_i - mean(r)) /
  (std(r) + eps), std with Bessel's correction (TRL's `torch.std`), eps 1e-4 (TRL's).
- The clipped surrogate of PPO per token: -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A),
  rho = exp(logp - logp_old); DAPO's clip_high above clip_low ("clip-higher").
- k3 (Schulman's estimator of KL(policy || reference)): exp(ref - logp) - (ref - logp) - 1, >= 0,
  0 with zero gradient where policy = reference.
- Aggregation (`loss_agg`), as token weights so that micro-batches and ranks add up to the global
  loss: `dapo` every completion token of the global batch weighs 1 / (its tokens); `grpo` each
  sequence's mean, then the mean over sequences (a token weighs 1 / (its length x sequences));
  `dr_grpo` (Dr. GRPO) 1 / (sequences x max_new_tokens), no length bias either way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

ADVANTAGE_EPS = 1e-4
LOSS_AGGREGATIONS = ("dapo", "grpo", "dr_grpo")
SCALINGS = ("group", "batch", "none")


def total_rewards(per_function: Sequence[Sequence[float | None]], weights: Sequence[float]) -> list[float | None]:
    """Each completion's reward: the weighted sum over the functions that scored it (a function
    answering None adds nothing); None where every function answered None."""
    out: list[float | None] = []
    for scores in zip(*per_function, strict=True):
        given = [(w, s) for w, s in zip(weights, scores, strict=True) if s is not None]
        out.append(sum(w * s for w, s in given) if given else None)
    return out


def group_advantages(rewards: Sequence[float | None], group_size: int, scale: str = "group",
                     eps: float = ADVANTAGE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, scored) for rewards laid out group after group (`group_size` completions of
    one prompt each). A None reward is left out of its group's mean and std, and its completion
    gets advantage 0 and `scored` False (it trains nothing). `scale`: divide by the group's std
    (`group`), by the std of every scored reward of the batch (`batch`), or not (`none`)."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards are not whole groups of {group_size}")
    if scale not in SCALINGS:
        raise ValueError(f"scale must be one of {SCALINGS}, got {scale!r}")
    scored = torch.tensor([r is not None for r in rewards])
    r = torch.tensor([math.nan if x is None else float(x) for x in rewards], dtype=torch.float64)
    groups, ok = r.view(-1, group_size), scored.view(-1, group_size)
    count = ok.sum(dim=1, keepdim=True)
    mean = torch.where(ok, groups, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(ok, groups - mean, 0.0)
    if scale == "group":
        std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    elif scale == "batch":
        centred = centred / (_std(r[scored]) + eps)
    return centred.view(-1).float(), scored


def _std(x: torch.Tensor) -> torch.Tensor:
    return x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype)


def zero_std_groups(rewards: Sequence[float | None], group_size: int) -> list[bool]:
    """Per group: whether its scored rewards are all equal (its advantages are all 0, so it
    trains nothing: DAPO's dynamic sampling drops such groups)."""
    out = []
    for g in range(0, len(rewards), group_size):
        scored = {x for x in rewards[g:g + group_size] if x is not None}
        out.append(len(scored) <= 1)
    return out


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each position, fp32: logits (B, T, V), targets (B, T) (any id where the
    position is not used, e.g. 0) -> (B, T)."""
    return -F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution, fp32: (B, T, V) -> (B, T)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference): exp(d) - d - 1 with d = ref - logp."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, low-clipped, high-clipped): -min(rho A, clip(rho, 1 - low, 1 + high) A),
    advantages (B,) broadcast over each sequence's tokens (B, T). Low-clipped: rho < 1 - low with
    A < 0; high-clipped: rho > 1 + high with A > 0 (the tokens whose gradient the clip stops)."""
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    loss = -torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    low = (ratio < 1 - clip_low) & (a < 0)
    high = (ratio > 1 + clip_high) & (a > 0)
    return loss, low, high


def token_weights(mask: torch.Tensor, loss_agg: str, *, sequences: int, tokens: int,
                  max_new_tokens: int) -> torch.Tensor:
    """Each completion token's weight in the loss (B, T), from the global batch's counts
    (`sequences` and completion `tokens` over every micro-batch and rank): the loss is the sum of
    weight x per-token loss. Masked positions weigh 0."""
    m = mask.float()
    if loss_agg == "dapo":
        return m / max(tokens, 1)
    if loss_agg == "grpo":
        return m / m.sum(dim=1, keepdim=True).clamp(min=1) / max(sequences, 1)
    if loss_agg == "dr_grpo":
        return m / (max(sequences, 1) * max_new_tokens)
    raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {loss_agg!r}")


def sequence_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of log p(target) over each sequence's masked positions (a completion's, never its
    prompt's): (B, T, V), (B, T), (B, T) bool -> (B,)."""
    return (token_logprobs(logits, targets.clamp(min=0)) * mask).sum(dim=1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss per pair (conservative DPO with `label_smoothing`), and the implicit
    rewards beta (logp - ref) of the chosen and rejected completions: (loss, chosen, rejected),
    each (pairs,). At policy = reference the loss is ln 2."""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    loss = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    return loss, beta * (policy_chosen - ref_chosen).detach(), beta * (policy_rejected - ref_rejected).detach()
