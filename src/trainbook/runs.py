"""The run directory: one archived experiment, laid out as DESIGN.md specifies.

    runs/<name>/<YYYYmmdd-HHMMSS>-<id>/
      recipe.toml  config.resolved.toml  env.json  tokenizer/
      logs/  metrics.jsonl  events.jsonl  checkpoints/ ...

`RunPaths` names every file and folder of it; each component is handed its own path.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainbook.config.secrets import scrub
from trainbook.errors import TrainbookError

@dataclass(frozen=True)
class RunPaths:
    """Every file and folder of a run directory, by name (`RunPaths.of(run_dir)`)."""

    root: Path
    recipe: Path
    """recipe.toml: the recipe exactly as given (secrets as fingerprints)."""
    config: Path
    """config.resolved.toml: every field after extends and overrides (rerunnable as a recipe)."""
    env: Path
    """env.json: the version matrix and the machine."""
    tokenizer: Path
    logs: Path
    """logs/rank<R>-<date>.log"""
    metrics: Path
    events: Path
    layers: Path
    """layers.jsonl: per-layer statistics at their cadence."""
    experts: Path
    """experts.jsonl: a mixture of experts' load per MoE layer at the logging cadence."""
    health: Path
    checkpoints: Path
    workers: Path
    """workers/: per-attempt records of the processes (who each worker is, the measured peak, the
    compile choice)."""
    incidents: Path
    hang: Path
    oom: Path
    profile: Path
    tensorboard: Path
    wandb: Path
    mlflow: Path
    report: Path
    """report.html, `trainbook report`'s default."""

    @classmethod
    def of(cls, root: str | Path) -> RunPaths:
        root = Path(root)
        return cls(
            root=root, recipe=root / "recipe.toml", config=root / "config.resolved.toml", env=root / "env.json",
            tokenizer=root / "tokenizer", logs=root / "logs", metrics=root / "metrics.jsonl",
            events=root / "events.jsonl", layers=root / "layers.jsonl", experts=root / "experts.jsonl",
            health=root / "health.json",
            checkpoints=root / "checkpoints", workers=root / "workers", incidents=root / "incidents",
            hang=root / "hang", oom=root / "oom", profile=root / "profile", tensorboard=root / "tb",
            wandb=root / "wandb", mlflow=root / "mlruns", report=root / "report.html",
        )

    def name(self, path: Path) -> str:
        """`path` as the run's records name it: relative to the run directory."""
        return str(path.relative_to(self.root))


# Distributions whose versions decide whether a run can be reproduced.
TRACKED_PACKAGES = (
    "trainbook", "torch", "torch_npu", "numpy", "tokenizers", "pydantic", "safetensors",
    "transformers", "typer", "rich", "tomli-w",
)


def new_run_dir_path(runs_root: str | Path, name: str) -> Path:
    """runs/<name>/<YYYYmmdd-HHMMSS>-<id>: a fresh name (the directory is not created)."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(runs_root) / name / f"{stamp}-{secrets.token_hex(3)}"


def create_run_dir(runs_root: str | Path, name: str, run_dir: str | Path | None = None) -> Path:
    """Make a fresh run directory; an existing non-empty one is never written into."""
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir_path(runs_root, name)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise TrainbookError(
            "directory is not empty; a run is never started on top of another",
            where=f"--run-dir {run_dir}",
        )
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return run_dir


def capture_env(world_size: int, device: torch.device, secrets: list[str] = ()) -> dict:
    """The version matrix and the facts of the machine a run ran on (env.json); `secrets` (the
    config's, `secret_values`) appear in its command line as their fingerprints."""
    env = {
        "time": time.time(),
        "host": socket.gethostname(),
        "command": [scrub(arg, list(secrets)) for arg in sys.argv],
        "cwd": os.getcwd(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "world_size": world_size,
        "device": str(device),
        "devices": _device_names(),
        "packages": _package_versions(),
        "git": _git_state(Path.cwd()),
    }
    env.update(_accelerator_versions())
    return env


def _device_names() -> list[str]:
    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if hasattr(torch, "npu") and torch.npu.is_available():  # registered by torch_npu
        return [torch.npu.get_device_name(i) for i in range(torch.npu.device_count())]
    return [cpu_name()]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _accelerator_versions() -> dict:
    versions = {}
    if torch.cuda.is_available():
        versions["cuda_driver"] = _command_output(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        )
    cann = os.environ.get("ASCEND_TOOLKIT_HOME")
    if cann:
        info = Path(cann) / "version.cfg"
        versions["cann"] = info.read_text().strip() if info.is_file() else cann
    return versions


def _package_versions() -> dict[str, str]:
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def _git_state(where: Path) -> dict | None:
    commit = _command_output(["git", "-C", str(where), "rev-parse", "HEAD"])
    if commit is None:
        return None
    status = _command_output(["git", "-C", str(where), "status", "--porcelain"])
    return {"commit": commit, "dirty": bool(status)}


def _command_output(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
