"""`trainbook run`: resolve, pre-flight, then train in this process or start the workers.

Every check that can fail on user input happens before the run directory exists, so a failed
start leaves nothing behind and never touches an existing run.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import tomllib
from pathlib import Path

import torch

from trainbook.atomic import atomic_write_json, atomic_write_text
from trainbook.commands.elastic import (
    is_restart, linger_if_peer_lost, restart_event, restart_line, write_worker_file,
)
from trainbook.commands.launch import Elastic, launch
from trainbook.commands.preflight import (
    ResumePoint, check_monitor, config_changes, gate, prepare_data, resume_point,
)
from trainbook.commands.recipe import archived_config, recipe_and_overrides
from trainbook.commands.resolve import Resolved, resolve
from trainbook.config import dump_toml, load_config, scrub, secret_values
from trainbook.data import Prepared
from trainbook.errors import TrainbookError
from trainbook.monitor import rewind_metrics
from trainbook.monitor.archive import read_jsonl
from trainbook.parallel import pick_device
from trainbook.parallel.runtime import Runtime, env_world_size, start_runtime
from trainbook.runs import RunPaths, capture_env, create_run_dir
from trainbook.train.dpo import dpo_inputs
from trainbook.train.grpo import grpo_inputs
from trainbook.train.build import build_trainer
from trainbook.train.settle import settle


def run_command(recipe: str | None, overrides: list[str] | None, run_dir: Path | None, resume: str,
                nproc: int | None, check: bool = True, elastic: Elastic = Elastic()) -> tuple[str | None, int]:
    """What `trainbook run` prints and its exit code. `check`: the cheap preflight first
    (preflight `gate`; the `--nproc` launcher runs it once for its workers). More than one
    process, or any of `elastic` (restarts, nodes): the workers run under the elastic agent.
    `nproc` None (and `elastic.nnodes` None): the recipe's `[launch]`."""
    path, overrides = recipe_and_overrides(recipe, overrides, archived_config(run_dir, resume))
    nproc, elastic = launch_defaults(path, overrides, nproc, elastic)
    if nproc > 1 or elastic != Elastic():
        return None, launch(path, overrides, nproc, run_dir, resume, check=check, elastic=elastic)
    world_size = env_world_size()
    res = resolve(path, overrides, world_size, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if check:
        gate(res)
    summary = start_run(res, run_dir, resume)
    if os.environ.get("RANK", "0") != "0":
        return None, 0  # rank 0 reports for the run
    loss = f", loss {summary['loss']:.4f}" if summary["loss"] is not None else ""
    val = f", val_loss {summary['val_loss']:.4f}" if summary["val_loss"] is not None else ""
    if summary["stopped_by"]:
        return (f"stopped by {summary['stopped_by']} at step {summary['step']}{loss}; continue with: "
                f"trainbook run --run-dir {summary['run_dir']}", 128 + signal.Signals[summary["stopped_by"]].value)
    return f"done: {summary['step']} steps{loss}{val} -> {summary['run_dir']}", 0


def launch_defaults(path: Path, overrides: list[str], nproc: int | None, elastic: Elastic) -> tuple[int, Elastic]:
    """`--nproc` and `--nnodes` where the command line gave them, else the recipe's `[launch]`.
    A worker (under torchrun already) is one process whatever the recipe says."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        return 1, dataclasses.replace(elastic, nnodes=elastic.nnodes or "1")
    if nproc is not None and elastic.nnodes is not None:
        return nproc, elastic
    launch_cfg = load_config(path, overrides).launch
    if elastic.nnodes is None and launch_cfg.nnodes > 1 and elastic.rdzv_endpoint is None:
        raise TrainbookError(
            f"{launch_cfg.nnodes} nodes need a rendezvous: run this on every node with --rdzv-endpoint HOST:PORT "
            "(or --nnodes 1 to try it on this machine alone)", where=f"{path}: launch.nnodes")
    nnodes = elastic.nnodes or str(launch_cfg.nnodes)
    return nproc or launch_cfg.nproc_per_node, dataclasses.replace(elastic, nnodes=nnodes)


def start_run(res: Resolved, run_dir: Path | None = None, resume: str = "auto") -> dict:
    """Train in this process (one of `res.world_size`): a new run directory, or a run continued
    from a checkpoint.

    `resume`: `auto` continues `run_dir` from its newest valid checkpoint when it holds a run
    (a new or empty directory starts fresh), `never` always starts fresh, anything else is the
    path of a checkpoint (or run) to continue from.
    """
    cfg = res.cfg
    device = pick_device(cfg.run.device)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    rt = start_runtime(res.dims, device, cfg.parallel.timeout_s, flight_recorder=cfg.parallel.hang_watch_s > 0)
    try:
        # Rank 0 checks and writes; every rank gets its answer (or its one-line error).
        start = rt.rank0_first(lambda: resume_point(res, resume, run_dir))
        rt.rank0_first(lambda: check_monitor(res))  # rank 0's sinks: before its run directory exists
        if rt.distributed:  # rank 0 fills the data cache; the others then read it
            rt.rank0_first(lambda: prepare_data(res) and None)
        data = prepare_data(res, log=_quiet if rt.distributed else print)
        if cfg.grpo.enabled:  # prompts and reward functions: before the run directory exists
            rt.rank0_first(lambda: grpo_inputs(cfg, data.tokenizer) and None)
        if cfg.dpo_enabled:  # preference pairs: before the run directory exists
            rt.rank0_first(lambda: dpo_inputs(cfg, data.tokenizer) and None)
        run_dir, dropped, changed = rt.rank0_first(lambda: _open_run_dir(res, run_dir, start, rt, data))
        if "TORCHELASTIC_RUN_ID" in os.environ:
            write_worker_file(run_dir)  # who this worker is, for the agent's failure recorder

        paths = RunPaths.of(run_dir)
        trainer = build_trainer(settle(cfg, rt, paths.workers), paths, data, rt)
        try:
            restart = restart_event(read_jsonl(paths.events), start.manifest["step"] if start else 0,
                                    rt.world_size) if rt.is_main else None
            if start is not None:
                trainer.resume(start.path, start.manifest["step"], skipped=start.skipped, changed=changed,
                               dropped_metric_lines=dropped)
            if restart is not None:
                trainer.restarted(restart, restart_line(restart))
            try:
                summary = trainer.fit()
            except Exception as e:
                linger_if_peer_lost(e)
                raise
        finally:
            trainer.close()  # joins the checkpoint threads: their collectives are over too
        rt.finish()  # every rank done: a barrier, then the exit (see Runtime.finish)
        return summary
    finally:
        rt.close()


def _quiet(*args, **kwargs) -> None:
    pass


def _open_run_dir(res: Resolved, run_dir: Path | None, start: ResumePoint | None, rt: Runtime,
                  data: Prepared) -> tuple[Path, int, dict]:
    """The run directory: the run being continued (metrics rewound), or a new, archived one."""
    cfg = res.cfg
    if start is None and is_restart() and run_dir is not None and RunPaths.of(run_dir).config.is_file():
        # The agent restarted a group that had saved no checkpoint yet: from step 0, in place.
        rewind_metrics(RunPaths.of(run_dir).experts, 0)
        return run_dir, rewind_metrics(RunPaths.of(run_dir).metrics, 0), {}
    if start is not None and start.run_dir is not None and RunPaths.of(start.run_dir).config.is_file():
        paths = RunPaths.of(start.run_dir)
        dropped = rewind_metrics(paths.metrics, start.manifest["step"])
        rewind_metrics(paths.experts, start.manifest["step"])  # its lines are the logged steps'
        changed = config_changes(start.manifest["config"], cfg)
        if changed:
            atomic_write_text(paths.config, dump_toml(cfg))
        return start.run_dir, dropped, changed
    paths = RunPaths.of(create_run_dir(cfg.run.runs_root, cfg.run.name, run_dir if start is None else start.run_dir))
    # Written as fingerprints, never as they are: the config's secrets, and the recipe's own where
    # the command line replaced them (the archived recipe is the file as given).
    recipe = res.recipe.read_text(encoding="utf-8")
    secrets = sorted({*secret_values(cfg.model_dump(mode="json")), *secret_values(tomllib.loads(recipe))},
                     key=len, reverse=True)
    atomic_write_text(paths.recipe, scrub(recipe, secrets))
    atomic_write_text(paths.config, dump_toml(cfg))
    env = capture_env(world_size=rt.world_size, device=rt.device, secrets=secrets)
    env["parallel"] = rt.dims.sizes()
    atomic_write_json(paths.env, env, indent=2)
    data.tokenizer.save(paths.tokenizer)
    return paths.root, 0, config_changes(start.manifest["config"], cfg) if start else {}
