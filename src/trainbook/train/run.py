"""From a recipe to a finished run: validate everything, prepare data, archive, train.

Every check that can fail on user input happens before the run directory exists, so a failed
start leaves nothing behind and never touches an existing run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainbook.config import Config, dump_toml, load_config
from trainbook.data import Prepared, prepare
from trainbook.errors import TrainbookError
from trainbook.model import resolve
from trainbook.parallel import pick_device
from trainbook.atomic import atomic_write_json, atomic_write_text
from trainbook.runs import capture_env, create_run_dir
from trainbook.train.trainer import Trainer


def resolve_config(recipe: Path, overrides: list[str]) -> Config:
    """The recipe after extends and overrides, with the model's registry entry filled in."""
    cfg = load_config(recipe, overrides)
    try:
        cfg = cfg.model_copy(update={"model": resolve(cfg.model)})
    except TrainbookError as e:
        e.where = f"{recipe}: {e.where}" if e.where else str(recipe)
        raise
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise TrainbookError(
            f"{cfg.train.seq_len} is longer than model.max_seq_len = {cfg.model.max_seq_len}",
            where=f"{recipe}: train.seq_len",
        )
    if cfg.parallel.world_size != 1:
        raise TrainbookError(
            f"layout needs {cfg.parallel.world_size} processes; this build trains in one process",
            where=f"{recipe}: parallel",
        )
    return cfg


def prepare_data(cfg: Config, recipe: Path, log=print) -> Prepared:
    data = prepare(cfg.data, cfg.tokenizer, seed=cfg.run.seed, log=log)
    if data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise TrainbookError(
            f"the tokenizer has {data.tokenizer.vocab_size} tokens but the model only "
            f"{cfg.model.vocab_size} embedding rows",
            where=f"{recipe}: model.vocab_size",
        )
    return data


def start_run(recipe: Path, overrides: list[str], run_dir: Path | None = None) -> dict:
    cfg = resolve_config(recipe, overrides)
    device = pick_device(cfg.run.device)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    data = prepare_data(cfg, recipe)

    run_dir = create_run_dir(cfg.run.runs_root, cfg.run.name, run_dir)
    atomic_write_text(run_dir / "recipe.toml", Path(recipe).read_text(encoding="utf-8"))
    atomic_write_text(run_dir / "config.resolved.toml", dump_toml(cfg))
    atomic_write_json(run_dir / "env.json", capture_env(world_size=1, device=device), indent=2)
    data.tokenizer.save(run_dir / "tokenizer")

    trainer = Trainer(cfg, run_dir, data, device)
    try:
        return trainer.fit()
    finally:
        trainer.close()
