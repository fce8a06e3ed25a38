"""`[grpo]`: reinforcement learning with verifiable rewards (GRPO, DAPO, Dr. GRPO).

Each rollout samples `group_size` completions of `prompts_per_step` prompts with the policy
itself, scores every completion with the reward functions, and turns each group's rewards into
advantages; the policy then takes `updates_per_rollout` optimizer steps on the clipped loss of
those completions (train/grpo.py, whose arithmetic is train/rl.py). GRPO is on when `reward`
names at least one function.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trainbook.config.section import Section


class RewardSpec(Section):
    function: str
    """`module:function`, called as `fn(prompts, completions, **columns) -> list[float | None]`
    (the columns: the prompt records' other fields, e.g. `answer`); None leaves a completion out
    of its group's statistics. Built-in: `trainbook.rewards:exact_answer`, `...:has_number`."""
    weight: float = 1.0
    """A completion's reward is the weighted sum of its functions' rewards."""

    @field_validator("function")
    @classmethod
    def _path(cls, v: str) -> str:
        module, sep, name = v.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"{v!r} is not module:function (e.g. trainbook.rewards:exact_answer)")
        return v


class GrpoConfig(Section):
    reward: list[RewardSpec] = []
    """The reward functions (`[[grpo.reward]]` tables); none: GRPO is off."""
    group_size: int = Field(default=8, ge=2)
    """Completions sampled per prompt: the group whose mean is each completion's baseline."""
    prompts_per_step: int = Field(default=8, ge=1)
    """Prompts of one rollout, over all data-parallel ranks (a multiple of their number)."""
    max_new_tokens: int = Field(default=64, ge=1)
    """A completion stops at EOS or the template's end of turn, or after this many tokens."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the rollouts (1: the policy's own distribution)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage = (r - group mean) / std: the group's std, the whole batch's, or none (Dr. GRPO)."""
    loss_agg: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    """`dapo`: token sum over the rollout's completion tokens; `grpo`: each sequence's mean, then
    the mean; `dr_grpo`: sum / (sequences x max_new_tokens)."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """The ratio's lower clip: 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0)
    """The ratio is clipped to [1 - clip_low, 1 + clip_high]; DAPO raises clip_high to 0.28."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty against the reference (the starting policy); 0 keeps no reference."""
    kl_estimator: Literal["k3"] = "k3"
    """KL estimate per token: k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    updates_per_rollout: int = Field(default=1, ge=1)
    """Optimizer steps on each rollout (1: the ratio is 1 and the loss is REINFORCE's with a baseline)."""
    filter_zero_std: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts
    drawn (up to `filter_max_draws` rollout batches a step) until each rank has its share of
    groups whose rewards differ; groups still missing then are equal-reward ones, which train no
    tokens and do not count in the loss's token total."""
    filter_max_draws: int = Field(default=4, ge=1)
    """With `filter_zero_std`: rollout batches a step may sample, its first included (DAPO's
    max_num_gen_batches); 1 drops equal-reward groups without drawing more."""
    reward_workers: int = Field(default=0, ge=0)
    """Worker processes (per rank) that run the reward functions, each rollout's completions split
    among them: for slow functions (a verifier, a sandboxed test run), and ones that may crash or
    hang. 0: they run in the trainer's own process."""
    reward_timeout_s: float = Field(default=600.0, gt=0)
    """With `reward_workers`: a function that has not scored a rollout after this long is an
    incident (its rewards for the rollout are unknown); its workers are killed and fresh ones
    start."""
    mask_truncated: bool = False
    """Completions that reach max_new_tokens without stopping train no tokens."""

    @property
    def enabled(self) -> bool:
        return bool(self.reward)

    @property
    def completions(self) -> int:
        """Completions of one rollout, over all ranks."""
        return self.group_size * self.prompts_per_step
