"""`[parallel]`: how the world's ranks are laid out, the pipeline's schedule, and how long a rank
waits on a collective before the hang watchdog and the timeout act."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainbook.config.section import Section


class ParallelConfig(Section):
    """How the world's ranks are laid out: dp_replicate x dp_shard x cp x tp x pp = world size.

    One degree may be -1: it takes whatever the others leave of the world size.
    """

    dp_replicate: int = Field(default=1, ge=-1)
    """Data-parallel replicas: the outer dimension of HSDP, or DDP's degree with `data_parallel = "ddp"`."""
    dp_shard: int = Field(default=-1, ge=-1)
    """Fully-sharded data parallel degree (FSDP2); -1 (default): the rest of the world."""
    tp: int = Field(default=1, ge=-1)
    """Tensor-parallel degree (with sequence parallel); must divide the heads and KV heads."""
    pp: int = Field(default=1, ge=-1)
    """Pipeline-parallel degree (ranks, each holding one or more stages)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree (a mixture of experts): each group of `ep` consecutive dp_shard ranks
    splits the routed experts between them, tokens travel to their experts and back by all-to-all,
    and the experts are FSDP-sharded over the other dp_shard / ep ranks. Must divide dp_shard and
    the number of experts; not with tp > 1 or pp > 1 yet."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel degree (parallel/cp.py): every sequence is split over `cp` ranks, each
    holding 1 / cp of its tokens (queries) and gathering every rank's keys and values in each
    attention; parameters are FSDP-sharded over dp_shard x cp. The sequence length must divide by
    2 x cp x tp (`cp_load_balance = "head_tail"`) or cp x tp. Not with pp > 1 and tp > 1 together,
    ep > 1, ddp, a mixture of experts, GRPO or DPO yet."""
    cp_load_balance: Literal["head_tail", "none"] = "head_tail"
    """How a sequence's tokens are dealt to the cp ranks: `head_tail` cuts it into 2 x cp chunks and
    gives rank r chunks r and 2 cp - 1 - r, so every rank has as much causal attention to compute;
    `none` gives rank r the r-th contiguous 1 / cp (the last rank then attends to the most keys)."""
    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    """`fsdp`: FSDP2 over dp_shard (HSDP when dp_replicate > 1 too); `ddp`: replicate (needs dp_shard = 1)."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """FSDP2: the dtype gradients are reduce-scattered in (its mixed-precision policy's
    `reduce_dtype`): `bf16` halves the bytes; FSDP casts each reduced shard back to the fp32
    gradient the optimizer reads. DDP compresses with `grad_compression` instead."""
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    """DDP: a PyTorch communication hook on every gradient bucket (parallel/compression.py):
    `bf16` / `fp16` all-reduce it cast down (half the bytes), `powersgd` a rank-`powersgd_rank`
    factorisation of each matrix with error feedback (what compression lost on a rank is added
    to its next gradient; checkpointed per rank, so a resume stays bitwise)."""
    powersgd_rank: int = Field(default=4, ge=1)
    """PowerSGD: the rank of each matrix's approximation P Q^T (a matrix n x m sends r (n + m)
    numbers instead of n m; one too small to gain twice is sent whole)."""
    powersgd_start_step: int = Field(default=10, ge=1)
    """PowerSGD: the first optimizer step compressed; the steps before all-reduce uncompressed
    (the gradients of the first steps change fastest)."""
    count_grad_bytes: bool = False
    """Count the bytes each rank hands to the gradient collectives (DDP and delayed
    synchronisation: through a counting process group; FSDP2: at its reduce-scatter;
    parallel/compression.py) and write them per step as `grad_bytes` in metrics.jsonl (what
    `plan` predicts, with or without a remedy)."""
    sync_every: int = Field(default=0, ge=0)
    """Delayed synchronisation (parallel/local_sgd.py): 0 synchronises gradients every step;
    H > 0 trains each DDP replica on its own for H steps (no gradient all-reduce), then takes an
    outer step on the replicas' average change (local SGD, DiLoCo): 1/H of the traffic. A
    checkpoint, the last step and a stop synchronise too, so every checkpoint holds one model."""
    outer_optimizer: Literal["nesterov", "average"] = "nesterov"
    """The outer step every `sync_every` steps: `nesterov` (DiLoCo) applies SGD with Nesterov
    momentum (`outer_lr`, `outer_momentum`) to the average of (last synchronised weights - each
    replica's weights); `average` (local SGD) sets the weights to the replicas' average."""
    outer_lr: float = Field(default=0.7, gt=0)
    """The outer Nesterov step's learning rate (DiLoCo's 0.7)."""
    outer_momentum: float = Field(default=0.9, ge=0, lt=1)
    """The outer Nesterov step's momentum (DiLoCo's 0.9)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = "1f1b"
    """Pipeline schedule."""
    pp_microbatches: int | None = Field(default=None, ge=1)
    """Micro-batches per pipeline pass (each micro-batch of `train.micro_batch_size` is cut into
    these); unset: the number of stages."""
    pp_split: list[int] | None = None
    """Layers per stage, e.g. [3, 3, 2]; unset: stages balanced by parameter count."""
    pp_stages_per_rank: int = Field(default=1, ge=1)
    """Stages each pipeline rank holds (`interleaved1f1b` needs >= 2)."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Collective timeout: a rank waiting longer than this on a collective fails with its name."""
    hang_timeout_s: float | None = Field(default=None, ge=0)
    """Hang watchdog (diagnose/hang.py): when no rank advances for this long, every rank writes its
    stacks to `hang/` and the run stops with a who-waits-for-whom verdict (exit 3). Unset: half of
    `timeout_s`; 0 turns the watchdog off. Must be below `timeout_s`, so the stacks are taken
    before a collective timeout kills anything."""

    stop_grace_s: float = Field(default=30.0, gt=0)
    """When the launcher stops the workers (pre-emption or Ctrl-C reaching it, or one worker's
    failure ending or restarting the group), how long each gets after SIGTERM to finish its step,
    save and exit before SIGKILL (torchrun's agent gives 30 s). A hung or SIGSTOPped worker never
    answers SIGTERM: the group's end or restart waits this long for it."""

    @field_validator("hang_timeout_s")
    @classmethod
    def _hang_below_timeout(cls, v: float | None, info: ValidationInfo) -> float | None:
        timeout = info.data.get("timeout_s")
        if v is not None and timeout is not None and v >= timeout:
            raise ValueError(f"must be below parallel.timeout_s ({timeout:g} s), so the stacks are taken "
                             f"before a collective timeout kills anything; got {v:g}")
        return v

    @property
    def hang_watch_s(self) -> float:
        """The hang watchdog's timeout in seconds; 0: off."""
        return self.timeout_s / 2 if self.hang_timeout_s is None else self.hang_timeout_s

    @model_validator(mode="after")
    def _one_rest(self) -> ParallelConfig:
        degrees = {k: getattr(self, k) for k in ("dp_replicate", "dp_shard", "tp", "pp")}
        if any(v == 0 for v in degrees.values()):
            raise ValueError("parallel degrees are >= 1, or -1 for the rest of the world")
        if sum(v == -1 for v in degrees.values()) > 1:
            raise ValueError(f"at most one degree may be -1 (the rest of the world); got {degrees}")
        return self
