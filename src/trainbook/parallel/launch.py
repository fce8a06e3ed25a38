"""`trainbook run --nproc N`: check everything once, then start N workers through torchrun.

The workers are PyTorch's own elastic agent (`torch.distributed.run --standalone`) running
`python -m trainbook run ...` with the same arguments, so a plain `torchrun -m trainbook run`
behaves the same. Everything that can fail on user input is checked here first (layout, config,
resume point, data), so a mistake is one line before any process starts; the data cache and the
run directory's name are settled here too, so every rank agrees on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from trainbook.errors import TrainbookError


def max_processes(device: torch.device) -> int:
    """One process per accelerator; on CPU, up to 4 per core (more only thrashes)."""
    if device.type == "cpu":
        return 4 * (os.cpu_count() or 1)
    return getattr(torch, device.type).device_count()


def launch(nproc: int, recipe: Path, overrides: list[str], run_dir: Path | None, resume: str) -> int:
    from trainbook.config import load_config
    from trainbook.parallel.device import pick_device
    from trainbook.runs import new_run_dir_path
    from trainbook.train.run import check_compatible, find_resume_point, prepare_data, resolve_config

    if "LOCAL_RANK" in os.environ:
        raise TrainbookError("already running under torchrun; drop --nproc", where="--nproc")
    device = pick_device(load_config(recipe, overrides).run.device)
    if nproc > max_processes(device):
        raise TrainbookError(f"{nproc} processes, but this machine allows {max_processes(device)} on "
                             f"{device.type} (one per accelerator, 4 per CPU core)", where="--nproc")
    cfg = resolve_config(recipe, overrides, world_size=nproc)
    start = find_resume_point(resume, run_dir)
    if start is not None:
        check_compatible(start.manifest, cfg, start.where)
    prepare_data(cfg, recipe)
    if run_dir is None:
        run_dir = start.run_dir if start is not None and start.run_dir is not None else \
            new_run_dir_path(cfg.run.runs_root, cfg.run.name)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "trainbook", "run", str(recipe), *overrides, "--run-dir", str(run_dir), "--resume", resume]
    if cfg.run.threads is None and device.type == "cpu":
        # torchrun would give each worker one thread; share the cores out instead.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd)
    # Pre-emption reaches this process first: hand it on (torchrun forwards it to the workers).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    return proc.wait()
