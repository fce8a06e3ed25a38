"""`trainbook run --nproc N`: resolve and pre-flight once, then start N workers through torchrun.

The workers are PyTorch's own elastic agent (`torch.distributed.run --standalone`) running
`python -m trainbook run ...` with the same arguments, so a plain `torchrun -m trainbook run`
behaves the same. Everything that can fail on user input is checked here first, by the same
resolution and pre-flight a single process runs (layout, config, batch, resume point, data), so a
mistake is one line before any process starts; the data cache, the run directory's name and an
`auto` micro-batch are settled here too, so every rank agrees on them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from trainbook.commands.preflight import check_monitor, gate, prepare_data, resume_point
from trainbook.commands.resolve import resolve
from trainbook.config import load_config
from trainbook.errors import DiagnosedFailure, TrainbookError
from trainbook.parallel.device import pick_device
from trainbook.runs import new_run_dir_path

DIAGNOSED_EVENTS = ("oom", "hang")  # events.jsonl kinds whose `verdict` stopped the run


def max_processes(device: torch.device) -> int:
    """One process per accelerator; on CPU, up to 4 per core (more only thrashes)."""
    if device.type == "cpu":
        return 4 * (os.cpu_count() or 1)
    return getattr(torch, device.type).device_count()


def launch(recipe: Path, overrides: list[str], nproc: int, run_dir: Path | None, resume: str,
           check: bool = True) -> int:
    """Resolve and pre-flight once for `nproc` ranks, then run them under torchrun; its exit code."""
    if "LOCAL_RANK" in os.environ:
        raise TrainbookError("already running under torchrun; drop --nproc", where="--nproc")
    device = pick_device(load_config(recipe, overrides).run.device)  # the machine before the layout
    if nproc > max_processes(device):
        raise TrainbookError(f"{nproc} processes, but this machine allows {max_processes(device)} on "
                             f"{device.type} (one per accelerator, 4 per CPU core)", where="--nproc")
    res = resolve(recipe, overrides, nproc, local_ranks=nproc)
    if check:
        gate(res)
    start = resume_point(res, resume, run_dir)
    check_monitor(res)
    prepare_data(res)
    if run_dir is None:
        run_dir = start.run_dir if start is not None and start.run_dir is not None else \
            new_run_dir_path(res.cfg.run.runs_root, res.cfg.run.name)
    if res.micro_batch_chosen:  # the workers take the number chosen here, not a choice of their own
        overrides = [*overrides, f"train.micro_batch_size={res.cfg.train.micro_batch_size}"]

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "trainbook", "run", str(recipe), *overrides, "--run-dir", str(run_dir), "--resume", resume,
           "--no-check"]  # the gate ran here, once
    if res.cfg.run.threads is None and device.type == "cpu":
        # torchrun would give each worker one thread; share the cores out instead.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd)
    # Pre-emption reaches this process first: hand it on (torchrun forwards it to the workers).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    code = proc.wait()
    # torchrun exits 1 whatever its workers' codes were. A run that stopped on a failure it
    # diagnosed says so in events.jsonl: rank 0 printed the verdict (its end event), or was
    # stopped by torchrun before it could (the failing rank's own event): exit as one process would.
    said, verdict = _diagnosis(Path(run_dir)) if code != 0 else (False, None)
    if said:
        return DiagnosedFailure.exit_code
    if verdict:
        raise DiagnosedFailure(verdict)
    return code


def _diagnosis(run_dir: Path) -> tuple[bool, str | None]:
    """(rank 0 ended on a diagnosed failure, the verdict of a diagnosed failure event) of the
    run's last attempt."""
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return False, None
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:  # a line cut short by a killed process
            continue
    starts = [i for i, e in enumerate(events) if e.get("kind") in ("start", "resume")]
    attempt = events[starts[-1]:] if starts else events
    said = any(e.get("kind") == "end" and str(e.get("error") or "").startswith(f"{DiagnosedFailure.__name__}:")
               for e in attempt)
    verdict = next((e["verdict"] for e in reversed(attempt) if e.get("kind") in DIAGNOSED_EVENTS), None)
    return said, verdict
