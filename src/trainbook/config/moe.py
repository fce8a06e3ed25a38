"""`[moe]`: how a mixture of experts (`model.n_experts`) keeps its experts busy while it trains.

Left to itself, a router learns to favour the experts it already favours: they get the gradient,
get better, get more tokens. Two remedies (train/experts.py computes both):

- `aux_loss` (Switch Transformer, Megatron, Qwen3-MoE's `router_aux_loss_coef`): each MoE layer
  adds E x sum_e f_e P_e to the loss, with f_e the share of the layer's (token, choice) pairs that
  went to expert e and P_e the mean router score of e (1 when the load is even, E / k when every
  token goes to the same k experts); the layers' mean, times `aux_loss_coef`, weighs on each
  micro-batch as the main loss does (1 / accumulation of it), and is never part of the reported
  loss.
- `bias` (DeepSeek-V3's auxiliary-loss-free balancing): after each optimizer step, every expert's
  selection bias (`feed_forward.router.expert_bias`, which chooses experts but never weights
  them) moves by `bias_update_rate` towards the mean load: up for an expert that got fewer
  tokens than the mean over the step (every micro-batch, every rank), down for one that got
  more. Routers without a bias gain one (zeros at first), so a model that had none (Qwen3-MoE)
  then routes in a way Hugging Face cannot express: its export is refused.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainbook.config.section import Section


class MoeConfig(Section):
    balance: Literal["none", "aux_loss", "bias"] = "none"
    """How experts are balanced: `aux_loss`, `bias` (above) or `none` (the router learns alone)."""
    aux_loss_coef: float = Field(default=1e-3, ge=0)
    """`aux_loss`: the balancing loss's weight against the main loss (Qwen3-MoE: 0.001)."""
    bias_update_rate: float = Field(default=1e-3, gt=0)
    """`bias`: how far each step moves an expert's selection bias (DeepSeek-V3: 0.001)."""
