"""From a recipe to a finished run: validate everything, prepare data, archive, train.

Every check that can fail on user input happens before the run directory exists, so a failed
start leaves nothing behind and never touches an existing run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainbook.checkpoint import InvalidCheckpoint, newest_valid, read_latest, step_of, verify
from trainbook.config import Config, TokenizerConfig, dump_toml, load_config
from trainbook.data import Prepared, prepare
from trainbook.errors import TrainbookError
from trainbook.model import resolve
from trainbook.model.registry import FROM_HF
from trainbook.monitor import rewind_metrics
from trainbook.parallel import pick_device
from trainbook.parallel.dims import resolve_dims
from trainbook.parallel.runtime import Runtime, env_world_size, start_runtime
from trainbook.atomic import atomic_write_json, atomic_write_text
from trainbook.runs import capture_env, create_run_dir
from trainbook.train.trainer import Trainer


def resolve_config(recipe: Path, overrides: list[str], world_size: int = 1) -> Config:
    """The recipe after extends and overrides, with the model's registry entry filled in, checked
    against the layout of `world_size` ranks (before any process group starts)."""
    cfg = load_config(recipe, overrides)
    try:
        if cfg.model.init_from:
            cfg = with_hf_model(cfg)
        cfg = cfg.model_copy(update={"model": resolve(cfg.model)})
    except TrainbookError as e:
        e.where = f"{recipe}: {e.where}" if e.where else str(recipe)
        raise
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise TrainbookError(
            f"{cfg.train.seq_len} is longer than model.max_seq_len = {cfg.model.max_seq_len}",
            where=f"{recipe}: train.seq_len",
        )
    resolve_dims(cfg, world_size, where=str(recipe))
    return cfg


def hf_dir(init_from: str) -> Path:
    kind, _, path = init_from.partition(":")
    if kind != "hf" or not path:
        raise TrainbookError(f"{init_from!r} is not hf:PATH (a Hugging Face Llama directory)", where="model.init_from")
    if not Path(path).is_dir():
        raise TrainbookError(f"{path} is not a directory", where="model.init_from")
    return Path(path)


def with_hf_model(cfg: Config) -> Config:
    """The model section filled from (or checked against) `init_from`'s config.json, and the
    directory's tokenizer as the run's tokenizer."""
    from trainbook.model.hf_import import check_against_recipe, hf_tokenizer_config, model_config_from_hf

    path = hf_dir(cfg.model.init_from)
    imported = model_config_from_hf(path)
    check_against_recipe(imported, cfg.model)
    # The imported architecture; the recipe may choose a larger vocabulary (resized after
    # loading), the RoPE table's length and the init std of re-initialised tensors.
    ours = cfg.model if cfg.model.name == FROM_HF else resolve(cfg.model)
    chosen = {k: getattr(ours, k) for k in ("vocab_size", "max_seq_len", "init_std") if getattr(ours, k) is not None}
    model = imported.model_copy(update={**chosen, "init_from": cfg.model.init_from, "resize_init": cfg.model.resize_init})
    tokenizer = TokenizerConfig(**hf_tokenizer_config(path))
    return cfg.model_copy(update={"model": model, "tokenizer": tokenizer})


def prepare_data(cfg: Config, recipe: Path, log=print) -> Prepared:
    try:
        data = prepare(cfg.data, cfg.tokenizer, seed=cfg.run.seed, log=log)
    except TrainbookError as e:  # a data error names the recipe and its key, like any other
        e.where = f"{recipe}: {e.where}" if e.where else str(recipe)
        raise
    if data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise TrainbookError(
            f"the tokenizer has {data.tokenizer.vocab_size} tokens but the model only "
            f"{cfg.model.vocab_size} embedding rows",
            where=f"{recipe}: model.vocab_size",
        )
    return data


def start_run(recipe: Path, overrides: list[str], run_dir: Path | None = None, resume: str = "auto") -> dict:
    """Train `recipe` in a new run directory, or continue a run from a checkpoint.

    `resume`: `auto` continues `run_dir` from its newest valid checkpoint when it holds a run
    (a new or empty directory starts fresh), `never` always starts fresh, anything else is the
    path of a checkpoint (or run) to continue from.
    """
    world_size = env_world_size()
    cfg = resolve_config(recipe, overrides, world_size)
    dims = resolve_dims(cfg, world_size, where=str(recipe))
    device = pick_device(cfg.run.device)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    rt = start_runtime(dims, device, cfg.parallel.timeout_s)
    try:
        # Rank 0 checks and writes; every rank gets its answer (or its one-line error).
        start = rt.rank0_first(lambda: find_resume_point(resume, run_dir))
        if start is not None:
            check_compatible(start.manifest, cfg, start.where)
        if rt.distributed:  # rank 0 fills the data cache; the others then read it
            rt.rank0_first(lambda: prepare_data(cfg, recipe) and None)
        data = prepare_data(cfg, recipe, log=_quiet if rt.distributed else print)
        run_dir, dropped, changed = rt.rank0_first(lambda: _open_run_dir(cfg, recipe, run_dir, start, rt, data))

        trainer = Trainer(cfg, run_dir, data, rt)
        try:
            if start is not None:
                trainer.checkpointer.discard_uncommitted(resumed_step=start.manifest["step"])
                trainer.load_checkpoint(start.path)
                trainer.record_resume(start.path, skipped=start.skipped, changed=changed,
                                      dropped_metric_lines=dropped)
            return trainer.fit()
        finally:
            trainer.close()
    finally:
        rt.close()


def _quiet(*args, **kwargs) -> None:
    pass


def _open_run_dir(cfg: Config, recipe: Path, run_dir: Path | None, start: ResumePoint | None, rt: Runtime,
                  data: Prepared) -> tuple[Path, int, dict]:
    """The run directory: the run being continued (metrics rewound), or a new, archived one."""
    if start is not None and start.run_dir is not None and (start.run_dir / "config.resolved.toml").is_file():
        dropped = rewind_metrics(start.run_dir / "metrics.jsonl", start.manifest["step"])
        changed = config_changes(start.manifest["config"], cfg)
        if changed:
            atomic_write_text(start.run_dir / "config.resolved.toml", dump_toml(cfg))
        return start.run_dir, dropped, changed
    run_dir = create_run_dir(cfg.run.runs_root, cfg.run.name, run_dir if start is None else start.run_dir)
    _archive(run_dir, recipe, cfg, rt, data)
    return run_dir, 0, config_changes(start.manifest["config"], cfg) if start else {}


def _archive(run_dir: Path, recipe: Path, cfg: Config, rt: Runtime, data: Prepared) -> None:
    atomic_write_text(run_dir / "recipe.toml", Path(recipe).read_text(encoding="utf-8"))
    atomic_write_text(run_dir / "config.resolved.toml", dump_toml(cfg))
    env = capture_env(world_size=rt.world_size, device=rt.device)
    env["parallel"] = rt.dims.sizes()
    atomic_write_json(run_dir / "env.json", env, indent=2)
    data.tokenizer.save(run_dir / "tokenizer")


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
        where = f"--run-dir {run_dir}"
        if not (run_dir / "config.resolved.toml").is_file():
            raise TrainbookError("is not empty and is not a trainbook run; use a new directory", where=where)
        skipped: list[tuple[str, str]] = []
        found = newest_valid(run_dir / "checkpoints", on_skip=lambda p, why: skipped.append((str(p), why)))
        if found is None:
            why = f" ({len(skipped)} invalid: {skipped[0][1]})" if skipped else ""
            raise TrainbookError(
                f"holds a run with no valid checkpoint to resume from{why}; start a new run in "
                "another directory", where=where,
            )
        return ResumePoint(found[0], found[1], run_dir, where, skipped)

    where = f"--resume {resume}"
    path = Path(resume)
    skipped: list[tuple[str, str]] = []
    if (path / "config.resolved.toml").is_file():  # a run: its newest valid checkpoint
        found = newest_valid(path / "checkpoints", on_skip=lambda p, why: skipped.append((str(p), why)))
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

    own_run = (ckpt_run / "config.resolved.toml").is_file()
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
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "tie_embeddings")


def check_compatible(manifest: dict, cfg: Config, where: str) -> None:
    saved = manifest.get("config", {}).get("model", {})
    for key in SHAPE_FIELDS:
        ours = getattr(cfg.model, key)
        if key in saved and saved[key] != ours:
            raise TrainbookError(f"checkpoint has {key}={saved[key]}, recipe has {ours}", where=where)


def config_changes(saved: dict, cfg: Config) -> dict[str, tuple]:
    """Flat `section.key` -> (checkpoint's value, this run's value) for every value that differs."""
    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    old, new = flat(saved), flat(cfg.model_dump(mode="json"))
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}
