"""`[optim]`, `[schedule]`, `[train]` and `[precision]`: the optimizer, its learning-rate schedule,
the loop (steps, batch, evaluation, what trains, compile, profiling) and the dtype a step computes in."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from trainbook.config.section import Section


class OptimConfig(Section):
    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay, applied to matrices only unless `decay_norms_and_embeddings`."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """AdamW beta2."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    decay_norms_and_embeddings: bool = False
    """Also apply weight decay to norm weights and embeddings."""


class ScheduleConfig(Section):
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape after warmup: cosine or linear decay to `min_lr_ratio * lr`, or constant."""
    warmup_steps: int = Field(default=100, ge=0)
    """Linear warmup from ~0 to the peak learning rate."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak (decaying schedules)."""


class TrainConfig(Section):
    max_steps: int = Field(default=1000, ge=1)
    """Optimizer steps to train."""
    stop_at_step: int | None = Field(default=None, ge=1)
    """End the run after this step, with everything else (the LR schedule above all) as if it
    went on to `max_steps`: a prefix of the full run, as `trainbook verify --steps N` runs it."""
    seq_len: int = Field(default=256, ge=2)
    """Tokens per sample."""
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = 8
    """Samples per forward/backward pass on each rank. `auto` (needs `global_batch_tokens`): the
    largest that divides each data-parallel rank's share of the global batch and fits the device
    by `trainbook plan`'s memory estimate; the resolved config records the number chosen."""
    global_batch_tokens: int | None = Field(default=None, ge=1)
    """Tokens per optimizer step over all ranks; a multiple of `seq_len * micro_batch_size *
    data-parallel ranks` (the quotient is the gradient accumulation). Unset: one micro-batch per
    step."""
    eval_every: int = Field(default=100, ge=0)
    """Evaluate on the held-out split every N steps (and at step 0 and the end); 0 disables."""
    eval_steps: int = Field(default=10, ge=1)
    """Validation batches per evaluation."""
    freeze: list[str] = []
    """Glob patterns over parameter names (e.g. "layers.[0-3].*", "tok_embeddings.*") that do not
    train: no gradients, no optimizer state."""
    reinit: list[str] = []
    """Glob patterns over parameter names re-initialised after loading (e.g. "output.*")."""
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: `full` all of every block, `selective` all but the
    matmul and attention outputs (cheap elementwise and norm ops are recomputed)."""
    compile: bool | Literal["auto"] = "auto"
    """Compile each block with `torch.compile` (after tensor parallel, before FSDP). `auto`: where
    it runs and the run is long enough to repay compiling (parallel/compile.py says the rule)."""
    loss_on: Literal["auto", "all", "assistant", "last_assistant", "completion"] = "auto"
    """Which targets are trained: `all`; `assistant` (every assistant turn of `chat` data, its
    end-of-turn token included); `last_assistant` (the last turn only); `completion` (the
    completion of `prompt_completion` data). `auto`: all for text, assistant for chat,
    completion for prompt_completion. Whatever it is, no label crosses into the next document
    of fine-tuning data."""
    loss: Literal["auto", "chunked", "full"] = "auto"
    """Cross entropy from `full` logits, or `chunked` (the head and the loss together, 2048 rows of
    logits at a time, model/loss.py). `auto`: chunked when compiled or when a micro-batch holds
    more than 2048 tokens, else full."""
    profile_phases: bool = False
    """Synchronise the device at every phase boundary, so the step's `phases` in metrics.jsonl are
    what each phase cost on the device (not only on the host). Costs the overlap of host and device."""
    profile_steps: list[int] | None = None
    """`[a, b]`: record steps a..b (1-based, inclusive) with `torch.profiler` into
    `profile/rank<R>-steps-a-b.json`, a Chrome/Perfetto trace with each phase as a named range."""

    @field_validator("profile_steps")
    @classmethod
    def _step_range(cls, steps: list[int] | None) -> list[int] | None:
        if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ValueError(f"{steps} is not [first, last] with 1 <= first <= last, e.g. [10, 12]")
        return steps

    @model_validator(mode="after")
    def _profile_within_run(self) -> TrainConfig:
        if self.stop_at_step is not None and self.stop_at_step > self.max_steps:
            raise ValueError(f"stop_at_step {self.stop_at_step} is after train.max_steps = {self.max_steps}")
        if self.profile_steps is not None and self.profile_steps[1] > self.max_steps:
            raise ValueError(f"profile_steps {self.profile_steps} ends after train.max_steps = {self.max_steps}")
        return self

    @property
    def last_step(self) -> int:
        """The step this run ends after: `stop_at_step`, else `max_steps`."""
        return self.stop_at_step or self.max_steps

    def grad_accum_steps(self, dp: int = 1) -> int:
        """Micro-batches per optimizer step on each of `dp` data-parallel ranks (of a resolved
        config: `micro_batch_size` is a number; the resolution checked that it divides)."""
        assert isinstance(self.micro_batch_size, int), "micro_batch_size = auto is settled by the resolution"
        per_micro = self.seq_len * self.micro_batch_size * dp
        return max(1, (self.global_batch_tokens or per_micro) // per_micro)


class PrecisionConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype: `bf16`/`fp16` run forward/backward in that dtype (autocast, or FSDP's
    mixed-precision policy); trained weights, optimizer state and gradient reduction stay fp32
    (frozen projection weights, e.g. LoRA's base, are held in the compute dtype: precision.py).
    `fp16` adds dynamic loss scaling."""
    loss_scale_init: float = Field(default=2.0**16, gt=0)
    """fp16: the first loss scale."""
    loss_scale_growth: float = Field(default=2.0, ge=1)
    """fp16: the scale is multiplied by this after `loss_scale_interval` steps without overflow."""
    loss_scale_interval: int = Field(default=2000, ge=1)
    """fp16: clean steps before the scale grows."""
    loss_scale_backoff: float = Field(default=0.5, gt=0, lt=1)
    """fp16: the scale is multiplied by this when a step's gradients overflow (the step is skipped)."""
    loss_scale_min: float = Field(default=1.0, gt=0)
    """fp16: the scale never goes below this."""

    @model_validator(mode="after")
    def _min_below_init(self) -> PrecisionConfig:
        if self.loss_scale_min > self.loss_scale_init:
            raise ValueError(f"loss_scale_min {self.loss_scale_min} is above loss_scale_init {self.loss_scale_init}")
        return self
