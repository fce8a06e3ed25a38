"""`[dpo]`: direct preference optimisation on preference pairs.

A step takes `pairs_per_step` records of the recipe's `preference` sources (a prompt, a chosen
and a rejected completion) and trains the policy to raise the chosen completion's log-probability
against the rejected one's, each measured relative to a reference model (train/dpo.py, whose
arithmetic is train/rl.py). DPO is on when the recipe's sources are `preference` data.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainbook.config.section import Section


class DpoConfig(Section):
    beta: float = Field(default=0.1, gt=0)
    """The implicit reward's scale: reward = beta x (policy log-prob - reference log-prob) of a
    completion; higher keeps the policy closer to the reference."""
    loss: Literal["sigmoid"] = "sigmoid"
    """The pairwise loss: -log sigmoid(chosen reward - rejected reward) (the DPO paper's)."""
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """Conservative DPO: the share of pairs assumed mislabelled (0: plain DPO)."""
    reference: Literal["frozen", "precompute", "adapter_off"] = "frozen"
    """The reference model: `frozen`, a whole copy of the starting model, forward only, kept for
    the run; `precompute`, that copy scores every pair once at start-up and is freed (memory of
    one model during training; start-up time of one pass over the data); `adapter_off`, with
    [lora], the policy itself with its adapters switched off (no second copy)."""
    pairs_per_step: int = Field(default=8, ge=1)
    """Preference pairs of one optimizer step, over all data-parallel ranks (a multiple of their
    number); `train.micro_batch_size` counts pairs too (a micro-batch runs 2 x that many rows)."""
