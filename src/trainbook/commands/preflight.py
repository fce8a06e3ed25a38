"""The one pre-flight: what a run needs beyond its recipe, checked before any process starts.

`gate` is `trainbook check`'s cheap part (the `[env]` version lock, free disk for the checkpoints);
`resume_point` finds (and checks) the checkpoint a run continues from; `prepare_data` makes the
data cache and checks the recipe against it (vocabulary, enough samples for one batch of every
rank); `check_monitor` checks that the switched-on metric sinks can start (the Prometheus port is
free, optional packages installed). `run` calls them in its one process, the `--nproc` launcher
before starting the workers (which call them again: rank 0 first, the others then find
everything in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainbook.checkpoint import InvalidCheckpoint, newest_valid, read_latest, step_of, verify
from trainbook.commands.resolve import Resolved
from trainbook.config import Config, dotted_keys, redact_tree, with_defaults
from trainbook.config.load import COMMAND_LINE
from trainbook.data import Prepared, check_train_split, check_val_split, padding_report, prepare
from trainbook.diagnose.preflight import disk_row, version_rows
from trainbook.errors import TrainbookError
from trainbook.model.families import config_as_built, with_options
from trainbook.model import build_model, num_params
from trainbook.monitor.external import check_sinks
from trainbook.commands.elastic import is_restart
from trainbook.runs import RunPaths


def prepare_data(res: Resolved, log=print) -> Prepared:
    """The recipe's data (cached after the first call), checked against the model and the batch."""
    cfg, where = res.cfg, str(res.recipe)
    try:
        data = prepare(cfg.data, cfg.tokenizer, seed=cfg.run.seed, log=log)
    except TrainbookError as e:  # a data error names the recipe and its key, like any other
        e.where = f"{where}: {e.where}" if e.where else where
        raise
    if data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise TrainbookError(
            f"the tokenizer has {data.tokenizer.vocab_size} tokens but the model only "
            f"{cfg.model.vocab_size} embedding rows",
            where=f"{where}: model.vocab_size",
        )
    t, packing = cfg.train, cfg.data.packing
    if cfg.grpo.enabled or cfg.dpo_enabled:  # prompts and pairs are read whole by the objective, not windowed
        return data
    try:
        check_train_split(data.train, t.seq_len, t.micro_batch_size, res.dims.dp, packing)
        if t.eval_every > 0:
            check_val_split(data.val, t.seq_len, packing)
    except TrainbookError as e:
        e.where = f"{where}: {e.where}"
        raise
    if packing == "pad":  # once, before training: what padding costs, what is cut
        log(padding_report(list(data.train.values()), t.seq_len).line())
    return data


def gate(res: Resolved) -> None:
    """`run`'s cheap part of the check, before anything is written: the version lock and free disk.
    The first failing row is a TrainbookError (exit 2) naming the key and the fix."""
    cfg = res.cfg
    if not cfg.env.enforce:
        return
    params = num_params(build_model(cfg.model, "meta", seed=0))
    rows = version_rows(cfg.env) + [disk_row(Path(cfg.run.runs_root), params, cfg.checkpoint.keep_last)]
    for row in rows:
        if row.status == "fail":
            overridden = any(item.partition("=")[0].strip() in (row.key, row.key.rpartition(".")[0])
                             for item in res.overrides)
            raise TrainbookError(
                f"{row.check} {row.detail}; fix: {row.fix} (or skip this check: run --no-check, "
                "or env.enforce = false)", where=f"{COMMAND_LINE if overridden else res.recipe}: {row.key}")


def check_monitor(res: Resolved) -> None:
    """The `[monitor]` sinks can start: a taken port or a missing package is one line, now."""
    try:
        check_sinks(res.cfg.monitor)
    except TrainbookError as e:
        overridden = any(item.partition("=")[0].strip() == e.where for item in res.overrides)
        e.where = f"{COMMAND_LINE if overridden else res.recipe}: {e.where}"
        raise


def resume_point(res: Resolved, resume: str, run_dir: Path | None) -> ResumePoint | None:
    """The checkpoint to continue from (None: a fresh start), checked against the recipe."""
    start = find_resume_point(resume, run_dir)
    if start is not None:
        check_compatible(start.manifest, res.cfg, start.where)
    return start


@dataclass
class ResumePoint:
    path: Path  # the checkpoint
    manifest: dict
    run_dir: Path | None  # where the run continues (None: a new run directory)
    where: str  # how the user named it, for errors
    skipped: list[tuple[str, str]] = field(default_factory=list)  # invalid newer checkpoints


def find_resume_point(resume: str, run_dir: Path | None) -> ResumePoint | None:
    """Which checkpoint a run continues from (None: a fresh start), checked before anything is written."""
    if resume == "never":
        return None
    if resume == "auto":
        if run_dir is None or not run_dir.is_dir() or not any(run_dir.iterdir()):
            return None
        where, paths = f"--run-dir {run_dir}", RunPaths.of(run_dir)
        if not paths.config.is_file():
            raise TrainbookError("is not empty and is not a trainbook run; use a new directory", where=where)
        skipped: list[tuple[str, str]] = []
        found = newest_valid(paths.checkpoints, on_skip=lambda p, why: skipped.append((str(p), why)))
        if found is None and is_restart():
            return None  # the agent restarted a group that had not saved yet: from step 0, in place
        if found is None:
            why = f" ({len(skipped)} invalid: {skipped[0][1]})" if skipped else ""
            raise TrainbookError(
                f"holds a run with no valid checkpoint to resume from{why}; start a new run in "
                "another directory", where=where,
            )
        return ResumePoint(found[0], found[1], run_dir, where, skipped)

    where = f"--resume {resume}"
    path = Path(resume)
    run = RunPaths.of(path)
    skipped: list[tuple[str, str]] = []
    if run.config.is_file():  # a run: its newest valid checkpoint
        found = newest_valid(run.checkpoints, on_skip=lambda p, why: skipped.append((str(p), why)))
        if found is None:
            raise TrainbookError("run has no valid checkpoint", where=where)
        (ckpt, manifest), ckpt_run = found, path
    elif (path / ".metadata").is_file() or (path / "manifest.json").is_file():
        try:
            manifest = verify(path)
        except InvalidCheckpoint as e:
            raise TrainbookError(f"is not a valid checkpoint: {e}", where=where) from None
        ckpt, ckpt_run = path, path.parent.parent
    else:
        raise TrainbookError("is neither a checkpoint nor a run directory", where=where)

    own_run = RunPaths.of(ckpt_run).config.is_file()
    target = run_dir if run_dir is not None else (ckpt_run if own_run else None)
    if target is not None and own_run and target.resolve() == ckpt_run.resolve():
        later = [s for s in map(step_of, ckpt.parent.iterdir())
                 if s is not None and manifest["step"] < s <= (read_latest(ckpt.parent) or 0)]
        if later:
            raise TrainbookError(
                f"the run has checkpoints after step {manifest['step']} (step-{max(later)}); continue it "
                "with --resume auto, or branch from this one with a new --run-dir", where=where,
            )
    elif target is not None and target.is_dir() and any(target.iterdir()):
        raise TrainbookError("is not empty; a run branched from a checkpoint needs a new directory",
                             where=f"--run-dir {target}")
    return ResumePoint(ckpt, manifest, target, where, skipped)


# Model fields that decide tensor shapes: a checkpoint cannot load into a model that differs in one.
# A mixture of experts adds its own: which layers route, how many experts of what size, and
# whether the routers hold a selection bias (a buffer the checkpoint has or has not); latent
# attention its latents' and heads' widths.
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qkv_bias", "qk_norm", "vocab_size", "ffn_dim",
                "tie_embeddings", "n_experts", "expert_ffn_dim", "n_shared_experts", "router_bias", "dense_layers",
                "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_compatible(manifest: dict, cfg: Config, where: str) -> None:
    saved = with_options(manifest.get("config", {}).get("model", {}))
    for key in SHAPE_FIELDS:
        ours = getattr(cfg.model, key)
        ours = list(ours) if isinstance(ours, tuple) else ours  # as the manifest's JSON holds a tuple
        if key in saved and saved[key] != ours:
            raise TrainbookError(f"checkpoint has {key}={saved[key]}, recipe has {ours}", where=where)


def config_changes(saved: dict, cfg: Config) -> dict[str, tuple]:
    """Flat `section.key` -> (checkpoint's value, this run's value) for every value that differs; a
    key added since the checkpoint was written counts as its default (`with_defaults`)."""
    old = dotted_keys(config_as_built(with_defaults(saved)))
    new = dotted_keys(redact_tree(cfg.model_dump(mode="json")))  # as manifests hold it
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}
