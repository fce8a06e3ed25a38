"""`trainbook run --nproc N`: resolve and pre-flight once, then start N workers through torchrun.

The workers are PyTorch's own elastic agent (`torch.distributed.run --standalone`) running
`python -m trainbook run ...` with the same arguments, so a plain `torchrun -m trainbook run`
behaves the same. Everything that can fail on user input is checked here first, by the same
resolution and pre-flight a single process runs (layout, config, batch, resume point, data), so a
mistake is one line before any process starts; the data cache, the run directory's name and an
`auto` micro-batch are settled here too, so every rank agrees on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from trainbook.commands.preflight import check_monitor, prepare_data, resume_point
from trainbook.commands.resolve import resolve
from trainbook.config import load_config
from trainbook.errors import DiagnosedFailure, TrainbookError
from trainbook.parallel.device import pick_device
from trainbook.runs import new_run_dir_path


def max_processes(device: torch.device) -> int:
    """One process per accelerator; on CPU, up to 4 per core (more only thrashes)."""
    if device.type == "cpu":
        return 4 * (os.cpu_count() or 1)
    return getattr(torch, device.type).device_count()


def launch(recipe: Path, overrides: list[str], nproc: int, run_dir: Path | None, resume: str) -> int:
    """Resolve and pre-flight once for `nproc` ranks, then run them under torchrun; its exit code."""
    if "LOCAL_RANK" in os.environ:
        raise TrainbookError("already running under torchrun; drop --nproc", where="--nproc")
    device = pick_device(load_config(recipe, overrides).run.device)  # the machine before the layout
    if nproc > max_processes(device):
        raise TrainbookError(f"{nproc} processes, but this machine allows {max_processes(device)} on "
                             f"{device.type} (one per accelerator, 4 per CPU core)", where="--nproc")
    res = resolve(recipe, overrides, nproc, local_ranks=nproc)
    start = resume_point(res, resume, run_dir)
    check_monitor(res)
    prepare_data(res)
    if run_dir is None:
        run_dir = start.run_dir if start is not None and start.run_dir is not None else \
            new_run_dir_path(res.cfg.run.runs_root, res.cfg.run.name)
    if res.micro_batch_chosen:  # the workers take the number chosen here, not a choice of their own
        overrides = [*overrides, f"train.micro_batch_size={res.cfg.train.micro_batch_size}"]

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "trainbook", "run", str(recipe), *overrides, "--run-dir", str(run_dir), "--resume", resume]
    if res.cfg.run.threads is None and device.type == "cpu":
        # torchrun would give each worker one thread; share the cores out instead.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd)
    # Pre-emption reaches this process first: hand it on (torchrun forwards it to the workers).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    code = proc.wait()
    # torchrun exits 1 whatever its workers' codes were: a run that stopped on a failure it
    # diagnosed (rank 0 printed the verdict) says so in its end event, and exits as one process would.
    return DiagnosedFailure.exit_code if code != 0 and _diagnosed(Path(run_dir)) else code


def _diagnosed(run_dir: Path) -> bool:
    """Whether the run's last end event says it stopped on a diagnosed failure."""
    import json

    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return False
    ends = [e for e in map(json.loads, filter(None, lines)) if e.get("kind") == "end"]
    return bool(ends) and str(ends[-1].get("error") or "").startswith(f"{DiagnosedFailure.__name__}:")
