"""The one resolution: (recipe, overrides, world size) -> a frozen `Resolved`.

Every check of user input that needs no data and no process lives here or below it (the schema,
`resolve_dims`), so `run`, `run --nproc N` and `plan` fail the same way, in one line, before any
process group starts and before anything is written. What it settles:
- the model section: a registry entry, or a Hugging Face directory's config.json (and its tokenizer);
- the layout (`ParallelDims`), checked against the model (heads, layers) and the batch;
- the batch: `train.micro_batch_size = "auto"` becomes a number (the largest that divides each
  data-parallel rank's share of the global batch and fits the device by `plan`'s estimate), and a
  fixed one that cannot work is an error naming the overrides that would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainbook.config import AlertsConfig, Config, TokenizerConfig, load_config
from trainbook.data import Tokenizer, hf_tokenizer_config
from trainbook.errors import TrainbookError
from trainbook.model import build_model, resolve as resolve_model
from trainbook.model.lora import targeted
from trainbook.model.registry import ARCH_FIELDS, FROM_HF
from trainbook.parallel.device import device_memory_bytes, pick_device
from trainbook.parallel.dims import ParallelDims, pipeline_microbatches, resolve_dims
from trainbook.parallel.heads import check_heads
from trainbook.parallel.plan_memory import PlanInputs
from trainbook.runs import RunPaths


def _check_secrets(cfg: Config, where: str) -> None:
    """A webhook URL named by an environment variable: the variable is set and holds an http(s)
    URL (the error never repeats the value)."""
    name = cfg.alerts.webhook_url_env
    if name is None:
        return
    if cfg.alerts.webhook_url is not None:
        raise TrainbookError("give the webhook URL once: alerts.webhook_url or alerts.webhook_url_env, not both",
                             where=f"{where}: alerts.webhook_url_env")
    url = os.environ.get(name)
    if not url:
        raise TrainbookError(f"the environment variable {name} is not set", where=f"{where}: alerts.webhook_url_env")
    try:
        AlertsConfig(webhook_url=url)
    except ValueError:
        raise TrainbookError(f"the environment variable {name} does not hold an http(s) URL with a host",
                             where=f"{where}: alerts.webhook_url_env") from None


@dataclass(frozen=True)
class Resolved:
    recipe: Path
    overrides: tuple[str, ...]
    cfg: Config
    """Every field settled: the model filled in, `micro_batch_size` a number."""
    dims: ParallelDims
    micro_batch_chosen: bool = False
    """`micro_batch_size` was `auto` in the recipe and chosen here."""

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.cfg.accum_steps(self.dims.dp)

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return self.accum_steps * t.micro_batch_size * self.cfg.rows_per_sample * t.seq_len * self.dims.dp

    def plan_inputs(self) -> PlanInputs:
        c = self.cfg
        g, t = c.grpo, c.train
        reference = (g.enabled and g.kl_coef > 0) or (c.dpo_enabled and c.dpo.reference == "frozen")
        rollout = (g.completions // self.dims.dp, t.seq_len) if g.enabled else None
        return PlanInputs(c.model, t, c.parallel, c.precision.dtype, c.lora, c.rows_per_sample, reference, rollout)


def resolve(recipe: Path, overrides: list[str], world_size: int, *, device_memory: int | None = None,
            local_ranks: int | None = None) -> Resolved:
    """The recipe after extends and overrides, settled for `world_size` ranks and checked.

    `local_ranks`: the run starts on this machine with that many ranks here: `run.device` must be
    available, and each rank gets its share of the device memory. `device_memory`: bytes one rank
    may use (else that share; neither: no limit), for `micro_batch_size = "auto"`.
    """
    recipe, where = Path(recipe), str(recipe)
    cfg = load_config(recipe, overrides)
    if local_ranks is not None:
        device = pick_device(cfg.run.device)
        device_memory = device_memory or device_memory_bytes(device, local_ranks)
    try:
        if cfg.model.init_from:
            cfg = with_run_model(cfg) if cfg.model.init_from.startswith(RUN_PREFIX) else with_hf_model(cfg)
        cfg = cfg.model_copy(update={"model": resolve_model(cfg.model)})
    except TrainbookError as e:
        e.where = f"{where}: {e.where}" if e.where else where
        raise
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise TrainbookError(f"{cfg.train.seq_len} is longer than model.max_seq_len = {cfg.model.max_seq_len}",
                             where=f"{where}: train.seq_len")
    _check_secrets(cfg, where)
    dims = resolve_dims(cfg.parallel, world_size, where)
    cfg = _with_balancing(cfg, dims, where)
    _check_model_layout(cfg, dims, where)
    _check_fine_tuning(cfg, dims, where)
    _check_grpo(cfg, dims, where)
    _check_dpo(cfg, dims, where)
    _check_lora(cfg, dims, where)
    chosen = cfg.train.micro_batch_size == "auto"
    mbs = _auto_micro_batch(cfg, dims, device_memory, where) if chosen else cfg.train.micro_batch_size
    _check_batch(cfg, dims, mbs, where)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": mbs})})
    return Resolved(recipe, tuple(overrides), cfg, dims, chosen)


def with_hf_model(cfg: Config) -> Config:
    """The model section filled from (or checked against) `init_from`'s config.json, and the
    directory's tokenizer as the run's tokenizer."""
    from trainbook.model.hf_import import check_against_recipe, hf_path, model_config_from_hf

    path = hf_path(cfg.model.init_from)
    imported = model_config_from_hf(path)
    check_against_recipe(imported, cfg.model)
    # The imported architecture; the recipe may choose a larger vocabulary (resized after
    # loading), the RoPE table's length and the init std of re-initialised tensors.
    ours = cfg.model if cfg.model.name == FROM_HF else resolve_model(cfg.model)
    chosen = {k: getattr(ours, k) for k in ("vocab_size", "max_seq_len", "init_std") if getattr(ours, k) is not None}
    model = imported.model_copy(update={**chosen, "init_from": cfg.model.init_from, "resize_init": cfg.model.resize_init})
    # The directory's tokenizer; a chat template the recipe names still overrides the directory's.
    tokenizer = TokenizerConfig(**hf_tokenizer_config(path), chat_template=cfg.tokenizer.chat_template)
    return cfg.model_copy(update={"model": model, "tokenizer": tokenizer})


RUN_PREFIX = "run:"
# Fields a recipe may set apart from the run it starts from (as from a Hugging Face folder).
_RECIPE_CHOOSES = ("vocab_size", "max_seq_len", "init_std")


def with_run_model(cfg: Config) -> Config:
    """The model section of the trainbook run (or checkpoint) `init_from = "run:PATH"` names, as
    its config.resolved.toml has it, and its tokenizer as the run's tokenizer.

    The recipe's own model fields must agree with the run's (a registry name is resolved and
    compared field by field), except those it may choose: a larger vocabulary (resized after
    loading), the RoPE table's length and the init std. A run whose tokenizer was trained
    (`train_bpe`) is read from its saved folder instead of being trained again on new data.
    """
    from trainbook.train.checkpoint_model import locate_run

    given = cfg.model
    path = given.init_from.removeprefix(RUN_PREFIX)
    if not path:
        raise TrainbookError(f"{given.init_from!r} is not run:PATH (a trainbook run directory or checkpoint)",
                             where="model.init_from")
    try:
        run_dir, ckpt, source = locate_run(Path(path))
    except TrainbookError as e:  # no valid checkpoint, not a run, an unreadable config
        said = e.message if e.where == path else str(e)
        raise TrainbookError(f"{given.init_from!r}: {said}", where="model.init_from") from None
    theirs = source.model
    ours = given
    if "name" in given.model_fields_set and given.name not in (FROM_HF, theirs.name):
        ours = resolve_model(given)  # a registry entry: every field of it must be the run's
    for field in ARCH_FIELDS:
        value = getattr(ours, field)
        if value is None or field in _RECIPE_CHOOSES:
            continue
        if value != getattr(theirs, field):
            raise TrainbookError(f"the recipe's model has {field}={value}, the run {run_dir} has "
                                 f"{field}={getattr(theirs, field)}", where=f"model.{field}")
    if ours.vocab_size is not None and ours.vocab_size < theirs.vocab_size:
        raise TrainbookError(f"the recipe's model has vocab_size={ours.vocab_size}, smaller than the run "
                             f"{run_dir}'s {theirs.vocab_size} (a vocabulary can grow, not shrink)",
                             where="model.vocab_size")
    chosen = {k: getattr(ours, k) for k in _RECIPE_CHOOSES if getattr(ours, k) is not None}
    model = theirs.model_copy(update={**chosen, "init_from": given.init_from, "resize_init": given.resize_init})
    return cfg.model_copy(update={"model": model, "tokenizer": _run_tokenizer(source.tokenizer, run_dir, cfg)})


def _run_tokenizer(theirs: TokenizerConfig, run_dir: Path, cfg: Config) -> TokenizerConfig:
    """The run's tokenizer settings; a trained one as the tokenizer.json it saved. A chat template
    the recipe names overrides the run's."""
    template = cfg.tokenizer.chat_template or theirs.chat_template
    if theirs.kind != "train_bpe":
        return theirs.model_copy(update={"chat_template": template})
    saved = RunPaths.of(run_dir).tokenizer
    tok = Tokenizer.load(saved)
    return TokenizerConfig(kind="hf", path=str(saved / "tokenizer.json"), eos_token=tok.eos_token,
                           bos_token=tok.bos_token, pad_token=tok.pad_token, add_bos=tok.add_bos,
                           chat_template=template)


def _check_lora(cfg: Config, dims: ParallelDims, where: str) -> None:
    """`[lora]`'s targets name linear layers of the model (built on the meta device)."""
    if not cfg.lora.enabled:
        return
    try:
        targeted(build_model(cfg.model, "meta", seed=0), cfg.lora.targets)
    except TrainbookError as e:
        e.where = f"{where}: {e.where}"
        raise


# `train.loss_on` -> the source formats whose targets it names (auto and all: any format).
LOSS_ON_FORMATS = {"assistant": ("chat", "prompt_completion"), "last_assistant": ("chat",),
                   "completion": ("prompt_completion",)}


def _check_fine_tuning(cfg: Config, dims: ParallelDims, where: str) -> None:
    """`train.loss_on` names targets every source has; chat data packs by document, off the pipeline."""
    formats = LOSS_ON_FORMATS.get(cfg.train.loss_on)
    for i, source in enumerate(cfg.data.sources):
        if formats is not None and source.format not in formats:
            raise TrainbookError(
                f"'{cfg.train.loss_on}' trains the targets of {' or '.join(formats)} data; source "
                f"'{source.name}' (data.sources[{i}]) is {source.format} (loss_on = 'auto' trains every token "
                "of text and the assistant turns of chat)", where=f"{where}: train.loss_on")
    chat = [s.name for s in cfg.data.sources if s.format in LOSS_ON_FORMATS["assistant"]]
    if not chat:
        if cfg.data.packing == "pad":  # text's loss has no mask to leave the padding out of
            raise TrainbookError("data.packing = 'pad' pads conversations (chat or prompt_completion sources); "
                                 "text packs by 'concat' or 'document'", where=f"{where}: data.packing")
        return
    if cfg.tokenizer.kind != "hf":  # the chat template's special tokens and character offsets
        raise TrainbookError(f"chat and prompt_completion data (source '{chat[0]}') need the model's own "
                             f"tokenizer.json (kind 'hf'), not kind '{cfg.tokenizer.kind}'",
                             where=f"{where}: tokenizer.kind")
    if cfg.data.packing == "concat":
        raise TrainbookError(f"chat and prompt_completion data (source '{chat[0]}') pack with data.packing = "
                             "'document' (positions and attention restart at every conversation) or 'pad' "
                             "(one conversation per sample)", where=f"{where}: data.packing")
    if dims.pp > 1:
        raise TrainbookError("fine-tuning's masked loss runs on one process, FSDP, DDP or TP; not in a pipeline",
                             where=f"{where}: parallel.pp")


def _check_grpo(cfg: Config, dims: ParallelDims, where: str) -> None:
    """`[grpo]` trains on `prompts` sources and they feed nothing else; a rollout's prompts split
    over the data-parallel ranks; its step is counted in completions, not tokens."""
    g = cfg.grpo
    prompts = [(i, s) for i, s in enumerate(cfg.data.sources) if s.format == "prompts"]
    if not g.enabled:
        if prompts:
            i, s = prompts[0]
            raise TrainbookError(f"source '{s.name}' (data.sources[{i}]) is format 'prompts', which reinforcement "
                                 "learning samples from: name a reward function in [[grpo.reward]], or train on "
                                 "chat or prompt_completion data", where=f"{where}: data.sources[{i}].format")
        return
    _check_sampled_steps(cfg, dims, where, "GRPO", "prompts", "grpo.prompts_per_step", g.prompts_per_step,
                         "grpo.prompts_per_step x grpo.group_size completions")


def _check_dpo(cfg: Config, dims: ParallelDims, where: str) -> None:
    """DPO trains on `preference` sources only, read by the model's own tokenizer; `adapter_off`
    needs adapters; a step's pairs split over the data-parallel ranks."""
    if not cfg.dpo_enabled:
        return
    if cfg.grpo.enabled:
        raise TrainbookError("a run trains one objective: [grpo] samples from prompts, DPO trains on preference "
                             "pairs; remove [[grpo.reward]] or the preference sources", where=f"{where}: grpo.reward")
    _check_sampled_steps(cfg, dims, where, "DPO", "preference", "dpo.pairs_per_step", cfg.dpo.pairs_per_step,
                         "dpo.pairs_per_step preference pairs")
    if cfg.tokenizer.kind != "hf":
        raise TrainbookError(f"preference data needs the model's own tokenizer.json (kind 'hf'), not kind "
                             f"'{cfg.tokenizer.kind}'", where=f"{where}: tokenizer.kind")
    if cfg.dpo.reference == "adapter_off" and not cfg.lora.enabled:
        raise TrainbookError("reference 'adapter_off' is the policy with its LoRA adapters off: add [lora], or use "
                             "'frozen' or 'precompute'", where=f"{where}: dpo.reference")


def _check_sampled_steps(cfg: Config, dims: ParallelDims, where: str, name: str, fmt: str, per_step_key: str,
                         per_step: int, step_is: str) -> None:
    """What GRPO and DPO share: every source is `fmt`; no pipeline; a step's items split over
    the data-parallel ranks and are counted in items, not tokens; no held-out loss."""
    t = cfg.train
    for i, s in enumerate(cfg.data.sources):
        if s.format != fmt:
            raise TrainbookError(f"{name} trains on format '{fmt}' sources; source '{s.name}' "
                                 f"(data.sources[{i}]) is {s.format}", where=f"{where}: data.sources[{i}].format")
    if dims.pp > 1:
        raise TrainbookError(f"{name} runs the whole model: one process, FSDP, DDP or TP; not a pipeline",
                             where=f"{where}: parallel.pp")
    if per_step % dims.dp:
        unit = "prompts" if fmt == "prompts" else "pairs"
        raise TrainbookError(f"{per_step} {unit} a step do not split over {dims.dp} data-parallel ranks",
                             where=f"{where}: {per_step_key}")
    if t.global_batch_tokens is not None:
        raise TrainbookError(f"a {name} step trains {step_is}; remove train.global_batch_tokens",
                             where=f"{where}: train.global_batch_tokens")
    if t.micro_batch_size == "auto":
        unit = "completions" if fmt == "prompts" else "pairs"
        raise TrainbookError(f"{name} needs a micro-batch size in {unit} (e.g. 8)", where=f"{where}: train.micro_batch_size")
    if t.eval_every:
        held_out = "reward" if fmt == "prompts" else "reward (or loss)"
        raise TrainbookError(f"{name} has no held-out loss: set train.eval_every = 0 and measure the held-out "
                             f"{held_out} with `trainbook eval`", where=f"{where}: train.eval_every")


def _with_balancing(cfg: Config, dims: ParallelDims, where: str) -> Config:
    """`[moe]` fits the model and layout; `moe.balance = bias` gives every router its selection
    bias (config/moe.py), which the resolved config then records (`model.router_bias = true`)."""
    moe, m = cfg.moe, cfg.model
    if moe.balance == "none":
        return cfg
    if m.n_experts is None:
        raise TrainbookError(f"moe.balance = {moe.balance} balances experts, and model {m.name!r} has none "
                             "(model.n_experts is unset)", where=f"{where}: moe.balance")
    if moe.balance == "aux_loss" and dims.pp > 1:
        raise TrainbookError("moe.balance = aux_loss is not supported with pp > 1 yet (the schedule runs "
                             "backward of the main loss alone); use bias", where=f"{where}: moe.balance")
    if moe.balance == "bias" and not m.router_bias:
        cfg = cfg.model_copy(update={"model": m.model_copy(update={"router_bias": True})})
    return cfg


def _check_model_layout(cfg: Config, dims: ParallelDims, where: str) -> None:
    m, p = cfg.model, cfg.parallel
    check_heads(m, dims.tp, where)
    if m.n_experts is not None and cfg.train.compile is True:
        raise TrainbookError("train.compile = true: a mixture of experts trains eager for now (its routers "
                             "keep eager bookkeeping: the recompute's choice, the token counts)",
                             where=f"{where}: train.compile")
    if dims.ep > 1 and m.n_experts is None:
        raise TrainbookError(f"parallel.ep = {dims.ep} splits a mixture of experts' experts; model {m.name!r} is dense",
                             where=f"{where}: parallel.ep")
    if dims.ep > 1 and m.n_experts % dims.ep:
        raise TrainbookError(f"the model's {m.n_experts} experts do not split evenly over ep = {dims.ep} ranks",
                             where=f"{where}: parallel.ep")
    if dims.ep > 1 and cfg.train.activation_checkpoint == "selective":
        # The experts' own FSDP unit inside each checkpointed block runs other profiler ops in the
        # recompute than in the forward, which torch 2.13's selective checkpointing refuses.
        raise TrainbookError("selective activation checkpointing does not run with expert parallelism yet; "
                             "use full (or none)", where=f"{where}: train.activation_checkpoint")
    if dims.cp > 1:
        _check_context_parallel(cfg, dims, where)
    if dims.pp == 1:
        return
    if cfg.precision.dtype == "fp16":
        raise TrainbookError("fp16 needs loss scaling, which the pipeline schedules do not apply yet; "
                             "use bf16 with pp > 1", where=f"{where}: precision.dtype")
    if cfg.data.packing == "document":
        raise TrainbookError("data.packing = document is not supported with pp > 1 yet (positions would "
                             "have to travel between stages); use concat", where=f"{where}: data.packing")
    stages = dims.pp * p.pp_stages_per_rank
    if p.pp_split is not None:
        if len(p.pp_split) != stages or any(n < 1 for n in p.pp_split) or sum(p.pp_split) != m.n_layers:
            raise TrainbookError(
                f"{p.pp_split} must be {stages} positive layer counts (one per stage) adding up to "
                f"model.n_layers = {m.n_layers}", where=f"{where}: parallel.pp_split",
            )
    elif m.n_layers < stages:
        raise TrainbookError(f"{stages} pipeline stages need at least {stages} layers; the model has {m.n_layers}",
                             where=f"{where}: parallel.pp")


def _check_context_parallel(cfg: Config, dims: ParallelDims, where: str) -> None:
    """What context parallelism (parallel/cp.py) needs of the recipe beyond the layout's degrees."""
    chunks = (2 if cfg.parallel.cp_load_balance == "head_tail" else 1) * dims.cp * dims.tp
    if cfg.train.seq_len % chunks:
        how = "2 x cp x tp" if cfg.parallel.cp_load_balance == "head_tail" else "cp x tp"
        raise TrainbookError(f"seq_len = {cfg.train.seq_len} does not split into {how} = {chunks} equal chunks "
                             f"(cp = {dims.cp}, tp = {dims.tp}, cp_load_balance = {cfg.parallel.cp_load_balance})",
                             where=f"{where}: train.seq_len")
    not_yet = {"model.n_experts": cfg.model.n_experts is not None and "a mixture of experts",
               "grpo": cfg.grpo.enabled and "GRPO (its rollouts sample whole sequences)",
               "dpo": cfg.dpo_enabled and "DPO (its sequence log-probabilities)",
               "data.packing": cfg.data.packing == "pad" and "pad packing (each micro-batch cut to its own width)"}
    for key, what in not_yet.items():
        if what:
            raise TrainbookError(f"context parallelism (parallel.cp = {dims.cp}) with {what} is not built yet",
                                 where=f"{where}: {key}")


def _divisors(n: int) -> list[int]:
    """Divisors of n, largest first."""
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def _rank_samples(cfg: Config, dims: ParallelDims, where: str) -> int:
    """Samples each data-parallel rank contributes to one step, when the global batch splits evenly."""
    t = cfg.train
    per_sample = t.seq_len * dims.dp
    if t.global_batch_tokens % per_sample:
        fix = max(per_sample, round(t.global_batch_tokens / per_sample) * per_sample)
        raise TrainbookError(
            f"global_batch_tokens = {t.global_batch_tokens} does not split into whole samples of seq_len "
            f"{t.seq_len} over {dims.dp} data-parallel ranks ({per_sample} tokens each); "
            f"set train.global_batch_tokens={fix}", where=f"{where}: train.global_batch_tokens")
    return t.global_batch_tokens // per_sample


def _auto_micro_batch(cfg: Config, dims: ParallelDims, device_memory: int | None, where: str) -> int:
    """The largest micro-batch that divides each rank's share of the global batch (and the
    pipeline's micro-batches) and fits `device_memory` by `plan`'s memory estimate."""
    if cfg.train.global_batch_tokens is None:
        raise TrainbookError("auto needs train.global_batch_tokens (the batch it divides); set it, or a number",
                             where=f"{where}: train.micro_batch_size")
    samples = _rank_samples(cfg, dims, where)
    step = pipeline_microbatches(cfg.parallel, dims.pp) if dims.pp > 1 else 1
    sizes = [d for d in _divisors(samples) if d % step == 0]
    if not sizes:
        raise TrainbookError(
            f"each data-parallel rank has {samples} samples per step, which cannot be cut into {step} pipeline "
            f"micro-batches; set train.global_batch_tokens to a multiple of "
            f"{cfg.train.seq_len * dims.dp * step}", where=f"{where}: train.micro_batch_size")
    if device_memory is None or len(sizes) == 1:
        return sizes[0]
    from trainbook.parallel.plan import largest_fitting

    inputs = PlanInputs(cfg.model, cfg.train, cfg.parallel, cfg.precision.dtype, cfg.lora)
    fitting = largest_fitting(inputs, dims, sizes, device_memory)
    return fitting if fitting is not None else sizes[-1]  # the smallest; plan says how far off


def _check_batch(cfg: Config, dims: ParallelDims, mbs: int, where: str) -> None:
    """A fixed micro-batch that the global batch (or the pipeline) cannot use: name the fixes."""
    t = cfg.train
    if dims.pp > 1:
        n = pipeline_microbatches(cfg.parallel, dims.pp)
        if mbs % n:
            raise TrainbookError(
                f"train.micro_batch_size = {mbs} cannot be cut into {n} pipeline micro-batches; set "
                f"train.micro_batch_size to a multiple of {n} (or auto)", where=f"{where}: parallel.pp_microbatches")
    if t.global_batch_tokens is None or t.global_batch_tokens % (t.seq_len * mbs * dims.dp) == 0:
        return
    per_step = t.seq_len * mbs * dims.dp
    fixes = ["train.micro_batch_size=auto"]
    if t.global_batch_tokens % (t.seq_len * dims.dp) == 0:
        samples = t.global_batch_tokens // (t.seq_len * dims.dp)
        fixes += [f"train.micro_batch_size={d}" for d in _divisors(samples)[:2]]
    fixes.append(f"train.global_batch_tokens={-(-t.global_batch_tokens // per_step) * per_step}")
    raise TrainbookError(
        f"global_batch_tokens = {t.global_batch_tokens} is not a multiple of seq_len x micro_batch_size x "
        f"data-parallel ranks = {t.seq_len} x {mbs} x {dims.dp} = {per_step}; set " + ", or ".join(fixes),
        where=f"{where}: train.global_batch_tokens")
