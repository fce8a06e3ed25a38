"""The recipe schema: one typed, frozen tree, one section per component.

Every field has a default and a docstring under it, which is its documentation (pydantic keeps
it as the field's description). Unknown keys are errors. Components receive their own section only, e.g. ``build_model(cfg.model)``.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainbook.config.book import EnvConfig, ExpectedFigure, LaunchConfig  # noqa: F401 (re-exported)
from trainbook.config.secrets import is_redacted
from trainbook.config.section import Section



class RunConfig(Section):
    name: str | None = None
    """Run name; runs are archived under `<runs_root>/<name>/`. Defaults to the recipe's file stem."""
    seed: int = 0
    """The one seed: model init, data order, dropout and sampling all derive from it."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where to train: `auto` picks cuda, then npu, then cpu."""
    runs_root: str = "runs"
    """Directory that holds the run archive, relative to the working directory."""
    threads: int | None = Field(default=None, ge=1)
    """CPU threads for intra-op parallelism (torch.set_num_threads); unset keeps torch's default."""


class SourceConfig(Section):
    name: str
    """Source name, used in reports and metrics."""
    paths: list[str] = Field(min_length=1)
    """Globs of input files; `pkg://PACKAGE/sub/dir/*.md` resolves inside an installed package."""
    format: Literal["text", "markdown", "jsonl", "parquet"] = "text"
    """`text`: one document per file (or per `separator`); `markdown`: same, markup stripped;
    `jsonl`: one document per line, in `text_field`; `parquet`: one per row of column `text_field`."""
    separator: str | None = None
    """`text`/`markdown`: split each file into documents on this string; unset: one per file."""
    text_field: str = "text"
    """`jsonl`: the field that holds the text; `parquet`: the column."""
    start_after: str | None = None
    """`text`/`markdown`: keep only what follows the first occurrence of this string in each file
    (e.g. Project Gutenberg's "*** START OF THE PROJECT GUTENBERG EBOOK"); a file without it is an error."""
    end_before: str | None = None
    """`text`/`markdown`: keep only what precedes the next occurrence of this string (after
    `start_after`, when set); a file without it is an error."""
    compression: Literal["auto", "none", "gzip", "zstd"] = "auto"
    """`auto` decides by file suffix (`.gz`, `.zst`); `parquet` files carry their own compression."""
    on_invalid_utf8: Literal["replace", "skip", "fail"] = "fail"
    """Bytes that are not UTF-8: replace them with U+FFFD, skip the document, or stop with an error."""
    weight: float = Field(default=1.0, gt=0)
    """Relative sampling weight of this source in the training mixture."""

    @model_validator(mode="after")
    def _markers_on_text(self) -> SourceConfig:
        if (self.start_after is not None or self.end_before is not None) and self.format not in ("text", "markdown"):
            raise ValueError(f"start_after and end_before apply to text and markdown files, not {self.format}")
        if "" in (self.start_after, self.end_before):
            raise ValueError("an empty marker; remove the key to keep the whole file")
        return self


class CleanConfig(Section):
    nfc: bool = True
    """Normalise text to Unicode NFC."""
    strip_control: bool = True
    """Remove control characters other than tab and newline."""
    min_chars: int = Field(default=1, ge=0)
    """Drop documents shorter than this after cleaning."""
    max_chars: int | None = Field(default=None, ge=1)
    """Drop documents longer than this after cleaning; unset: no limit."""


class DedupConfig(Section):
    exact: bool = True
    """Drop documents whose cleaned text was already seen (sha256)."""
    near: bool = False
    """Drop near-duplicates: MinHash signatures with LSH over word shingles."""
    shingle_size: int = Field(default=5, ge=1)
    """Words per shingle for near-duplicate detection."""
    threshold: float = Field(default=0.8, gt=0, le=1)
    """Estimated Jaccard similarity at or above which a document is a near-duplicate."""
    num_perm: int = Field(default=128, ge=16)
    """MinHash permutations (more: slower, more precise)."""


class DataConfig(Section):
    sources: list[SourceConfig] = Field(default_factory=list)
    """The corpus: a list of sources (`[[data.sources]]` tables)."""
    clean: CleanConfig = CleanConfig()
    """Cleaning applied to every document before deduplication and tokenization."""
    dedup: DedupConfig = DedupConfig()
    """Exact and near-duplicate removal across all sources."""
    cache_dir: str = ".trainbook/cache"
    """Where prepared token shards are cached, keyed by the hash of the inputs and tokenizer."""
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Fraction of documents held out for validation (at least one document when > 0)."""
    shard_tokens: int = Field(default=50_000_000, ge=1024)
    """Maximum tokens per shard file."""
    num_proc: int = Field(default=1, ge=1)
    """Processes that tokenize during `prepare`."""
    packing: Literal["concat", "document"] = "concat"
    """`concat`: documents joined with EOS and cut into windows; `document`: the same windows, but
    positions restart and attention stops at every document boundary."""
    num_workers: int = Field(default=0, ge=0)
    """Background processes that assemble batches; 0 assembles them in the training process."""
    pin_memory: bool | None = None
    """Page-lock batches for faster host-to-device copies; unset: on when training on an accelerator."""


class TokenizerConfig(Section):
    kind: Literal["train_bpe", "hf", "sentencepiece", "tiktoken"] = "train_bpe"
    """`train_bpe`: train a byte-level BPE on the corpus; `hf`: a `tokenizer.json`; `sentencepiece`:
    a `.model` file; `tiktoken`: a tiktoken rank file (`.tiktoken`) or GPT-2 `encoder.json` + `vocab.bpe`."""
    path: str | None = None
    """Tokenizer file (for `tiktoken` GPT-2 files: the directory holding them)."""
    vocab_size: int = Field(default=2048, ge=260)
    """Vocabulary size when training a tokenizer (256 bytes + specials + merges)."""
    eos_token: str | None = None
    """End-of-document token placed between packed documents; unset: the tokenizer's own
    (`<|endoftext|>` for trained and tiktoken BPEs, the model's EOS for SentencePiece)."""
    bos_token: str | None = None
    """Beginning-of-document token; unset: the tokenizer's own, if it has one."""
    pad_token: str | None = None
    """Padding token; unset: the tokenizer's own, if it has one."""
    add_bos: bool = False
    """Put the BOS token at the start of every document."""
    tiktoken_encoding: Literal["cl100k_base", "o200k_base", "llama3"] | None = None
    """`tiktoken` rank file: the encoding it belongs to, which fixes what the file does not hold,
    the split regex and the special tokens: `cl100k_base` (GPT-4), `o200k_base` (GPT-4o), each
    as tiktoken defines it; `llama3` (Meta Llama 3: BOS `<|begin_of_text|>`, EOS
    `<|end_of_text|>`, 256 specials from id 128000). Unset: GPT-2's regex and `<|endoftext|>`
    at the first id no rank uses (right for `r50k_base` and `p50k_base`)."""
    tiktoken_pattern: str | None = None
    """`tiktoken` rank file: the split regex (tiktoken's syntax), in place of the encoding's."""
    tiktoken_special_tokens: dict[str, int] | None = None
    """`tiktoken` rank file: special token -> id (ids no rank uses), in place of the encoding's;
    e.g. Llama 3.1's names for the reserved ids. EOS/BOS default to `<|endoftext|>` or
    `<|end_of_text|>`, and `<|begin_of_text|>`, where present."""

    @field_validator("tiktoken_encoding", "tiktoken_pattern", "tiktoken_special_tokens")
    @classmethod
    def _tiktoken_only(cls, value, info: ValidationInfo):
        kind = info.data.get("kind")
        if value is not None and kind != "tiktoken":
            raise ValueError(f"applies to kind 'tiktoken' only, not '{kind}'")
        return value


class ModelConfig(Section):
    name: str = "tiny"
    """A registry name (`trainbook.model.registry`), or `from_hf`: the architecture of `init_from`'s
    config.json; the fields below override its values."""
    init_from: str | None = None
    """`hf:PATH`: start from a Hugging Face Llama directory's weights (and use its tokenizer)."""
    resize_init: Literal["mean", "normal"] = "mean"
    """Rows added when `vocab_size` exceeds the imported vocabulary: the mean of the existing
    embeddings, or normal(0, init_std)."""
    dim: int | None = Field(default=None, ge=1)
    """Hidden size."""
    n_layers: int | None = Field(default=None, ge=1)
    """Number of transformer blocks."""
    n_heads: int | None = Field(default=None, ge=1)
    """Attention heads."""
    n_kv_heads: int | None = Field(default=None, ge=1)
    """Key/value heads (grouped-query attention); must divide `n_heads`."""
    vocab_size: int | None = Field(default=None, ge=1)
    """Embedding rows; must be at least the tokenizer's vocabulary."""
    ffn_dim: int | None = Field(default=None, ge=1)
    """SwiGLU hidden size."""
    norm_eps: float | None = Field(default=None, gt=0)
    """RMSNorm epsilon."""
    rope_theta: float | None = Field(default=None, gt=0)
    """RoPE base frequency."""
    max_seq_len: int | None = Field(default=None, ge=1)
    """Longest sequence the RoPE table covers."""
    tie_embeddings: bool | None = None
    """Share the token embedding with the output head."""
    init_std: float | None = Field(default=None, gt=0)
    """Standard deviation of the normal weight init (output projections scaled by depth)."""


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
    mixed-precision policy); weights, optimizer state and gradient reduction stay fp32.
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


class ParallelConfig(Section):
    """How the world's ranks are laid out: dp_replicate x dp_shard x tp x pp = world size.

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
    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    """`fsdp`: FSDP2 over dp_shard (HSDP when dp_replicate > 1 too); `ddp`: replicate (needs dp_shard = 1)."""
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


class CheckpointConfig(Section):
    interval_steps: int = Field(default=0, ge=0)
    """Save every N steps; 0 saves only at the end of training (and on SIGTERM/SIGINT)."""
    interval_minutes: float = Field(default=0.0, ge=0)
    """Also save when this many minutes have passed since the last save; 0 turns it off."""
    mode: Literal["sync", "async"] = "sync"
    """`async`: training continues while the state is written (one save in flight at most)."""
    keep_last: int = Field(default=3, ge=1)
    """Keep the newest N checkpoints; older ones are deleted in the background after a save."""
    keep_every: int = Field(default=0, ge=0)
    """Also keep every checkpoint whose step is a multiple of N (milestones); 0 keeps none extra."""


class LogConfig(Section):
    every_steps: int = Field(default=10, ge=1)
    """Write metrics and a log line every N steps."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the run log files."""
    retention_days: int = Field(default=30, ge=1)
    """Delete per-day log files older than this."""
    progress: Literal["auto", "bar", "plain"] = "auto"
    """`auto`: a progress bar on a terminal, plain log lines otherwise."""


class MonitorConfig(Section):
    """Where a run's facts go besides metrics.jsonl, events.jsonl and the logs (always written).
    Key names are a contract that scripts use."""

    tensorboard: bool = True
    """Write TensorBoard event files to `<run>/tb/`: scalars, and histograms of the layer statistics."""
    prometheus_port: int = Field(default=0, ge=0, le=65535)
    """Serve Prometheus metrics on this port (rank 0); 0 = off."""
    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds to: localhost unless you mean otherwise."""
    layer_stats_every: int = Field(default=100, ge=0)
    """Every N steps: per block and parameter group gradient/parameter norms, update-to-weight
    ratio and activation statistics (`layers.jsonl`, TensorBoard); 0 = off."""
    wandb: bool = False
    """Log to Weights & Biases (`pip install trainbook[wandb]`); offline unless `WANDB_MODE` says otherwise."""
    wandb_project: str | None = None
    """W&B project; unset: the run name."""
    mlflow: bool = False
    """Log to MLflow (`pip install trainbook[mlflow]`)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; unset: a local file store in `<run>/mlruns`."""
    tracker_close_timeout_s: float = Field(default=60.0, gt=0)
    """At the end of a run, how long W&B and MLflow may take to send what is still queued (they log
    from a background thread, so a slow server never holds up a step); past it the rest is dropped."""


class DiagnoseConfig(Section):
    """What the failure diagnoses record beyond what they always do."""

    memory_history: bool = False
    """Record memory for an out-of-memory post-mortem: the bytes each block saves for backward
    (saved-tensor hooks, measured instead of estimated in `oom/breakdown.json`), and on CUDA the
    allocator's history, dumped to `oom/snapshot.pickle` (pytorch.org/memory_viz). Costs a hook
    per saved tensor."""


class TriageConfig(Section):
    """What a bad step does to the run (diagnose/triage.py). A step is bad when its loss or
    gradient norm is non-finite, or its loss spikes by the robust rule; every rank judges the same
    global values and they agree in one collective, before the update. The step is then re-run
    once with hooks on every module (transient or reproducible; the first module whose output or
    gradient is non-finite), and `incidents/step-N/` holds the batch, its source documents and
    the step's numbers. A transient fault (the re-run is clean) trains on with the re-run's
    update; a reproducible one meets the policy: `stop` (exit 3 with the verdict), `skip` (no
    update: weights and optimizer state stay as they were; the step's data is spent), `rollback`
    (reload the newest checkpoint at least `rollback_steps_back` steps before the bad step and
    skip the next `rollback_skip_batches` batches of data after it), `ignore` (no judgement: the
    update is applied, as without triage). An fp16 overflow is the loss scaler's skip, not a bad step."""

    on_nonfinite: Literal["stop", "skip", "rollback", "ignore"] = "stop"
    """Policy for a non-finite loss or gradient norm."""
    on_spike: Literal["stop", "skip", "rollback", "ignore"] = "ignore"
    """Policy for a loss spike: `spike_z` robust sigmas above the trend of the last `window` good
    steps (the `loss_spike` alert's rule; judged once the LR warmup is over and a window has passed)."""
    spike_z: float = Field(default=6.0, gt=0)
    """Robust z-score above which a step's loss is a spike."""
    window: int = Field(default=50, ge=5)
    """Good steps the spike rule's trend is fitted to."""
    rollback_steps_back: int = Field(default=0, ge=0)
    """Rollback restarts from the newest checkpoint at least this many steps before the bad step
    (PaLM restarted about 100 steps before a spike); 0: the newest checkpoint."""
    rollback_skip_batches: int = Field(default=200, ge=0)
    """Batches (optimizer steps' worth of data) skipped after the checkpoint rolled back to (PaLM
    skipped 200-500); recorded in events.jsonl, so a later resume from that checkpoint skips them too."""
    max_rollbacks: int = Field(default=5, ge=1)
    """Rollbacks a run may make; one more bad step is a stop (data is not the cause)."""


ALERT_RULES = ("nonfinite", "loss_spike", "grad_spike", "throughput_drop", "stall", "memory_growth",
               "val_regression", "mix_drift", "straggler")


class AlertsConfig(Section):
    """Rules that watch the run, and where a fired alert goes (the log and events.jsonl always)."""

    rules: list[str] = Field(default_factory=lambda: list(ALERT_RULES))
    """Rule ids that are on: nonfinite, loss_spike, grad_spike, throughput_drop, stall,
    memory_growth, val_regression, mix_drift, straggler (per-rank step time and data wait compared
    each logging interval; a rank slower than the others by the robust rule for 3 intervals in a
    row is an alert naming rank, host and where its time goes: data, compute, communication)."""
    webhook_url: str | None = None
    """POST each alert as JSON here, an http(s) URL (a background thread with timeout and retries;
    never blocks training). A secret: trainbook writes only its fingerprint (`redacted:sha256:...`,
    config/secrets.py), and an archived config that holds one posts nowhere."""
    webhook_url_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The name of an environment variable holding the webhook URL (instead of `webhook_url`), so
    the secret is in no recipe and no command line; checked before the run starts."""
    command: list[str] | None = Field(default=None, min_length=1)
    """Run this argv (never a shell) for each alert, with the alert as JSON on stdin (timeout:
    `webhook_timeout_s`)."""
    window: int = Field(default=50, ge=5)
    """Steps of history the spike, throughput and memory rules judge a new step against."""
    loss_spike_z: float = Field(default=6.0, gt=0)
    """Robust z-score (median/MAD over `window`) above which a loss is a spike."""
    grad_spike_z: float = Field(default=10.0, gt=0)
    """Robust z-score above which a gradient norm is a spike."""
    throughput_drop: float = Field(default=0.5, gt=0, lt=1)
    """Alert when tokens/s falls below this fraction of the rolling median."""
    stall_s: float = Field(default=600.0, gt=0)
    """Alert when no step has completed for this many seconds (a heartbeat thread watches)."""
    memory_growth_bytes_per_step: int = Field(default=1 << 20, ge=0)
    """Alert when peak memory grows faster than this per step over `window` steps (a leak)."""
    val_regression: float = Field(default=0.05, ge=0)
    """Alert when the validation loss rises this fraction above its best so far."""
    mix_drift: float = Field(default=0.1, gt=0, lt=1)
    """Alert when a source's share of consumed tokens is this far (absolute) from its weight's share."""
    straggler_frac: float = Field(default=0.2, gt=0)
    """A rank is late when the others wait for it more than this fraction of the median step time
    (and at least 5 ms) in a probed step; `straggler` fires after 3 probed steps in a row."""
    straggler_every: int = Field(default=4, ge=1)
    """The straggler probes run on every this-many-th logged step (each probe: device syncs and a
    one-element all-reduce of the world, 2 + accumulation of them in a probed step). Measured by
    benchmarks/stragglers.py (2 ranks, gloo, the default recipe): a probed step costs 3.4% more; at
    the default `log.every_steps` (10) every 4th logged step keeps the average under 0.1%, and a
    straggler is named after 3 probed intervals (120 steps)."""
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    """Timeout of one webhook POST."""
    webhook_retries: int = Field(default=3, ge=0)
    """Retries of a failed POST, with exponential backoff."""
    repeat_after_s: float = Field(default=300.0, ge=0)
    """One rule fires again only after this many seconds (deduplication and rate limit)."""

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is None or is_redacted(url):
            return url
        parts = urllib.parse.urlsplit(url)
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number in range
        except ValueError as e:
            raise ValueError(f"{url!r} is not a valid URL: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
            raise ValueError(f"{url!r} is not an http(s) URL with a host, e.g. 'https://hooks.example.com/alerts'")
        return url

    @field_validator("rules")
    @classmethod
    def _known_rules(cls, rules: list[str]) -> list[str]:
        unknown = [r for r in rules if r not in ALERT_RULES]
        if unknown:
            raise ValueError(f"unknown rule {unknown[0]!r}; rules are {', '.join(ALERT_RULES)}")
        return rules


class Config(Section):
    """A whole recipe. `extends` is consumed while loading and never appears here."""

    run: RunConfig = RunConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig()
    precision: PrecisionConfig = PrecisionConfig()
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    monitor: MonitorConfig = MonitorConfig()
    alerts: AlertsConfig = AlertsConfig()
    env: EnvConfig = EnvConfig()
    launch: LaunchConfig = LaunchConfig()
    expect: list[ExpectedFigure] = []
    """Published figures this recipe should reach (`[[expect]]` tables), each with its source."""
    diagnose: DiagnoseConfig = DiagnoseConfig()
    triage: TriageConfig = TriageConfig()
