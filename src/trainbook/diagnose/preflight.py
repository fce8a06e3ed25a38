"""Preflight probes: one `Row` (pass / warn / fail / skip, what was found, the fix) per question
`trainbook check` asks of this machine before a run.

- `version_rows`: the recipe's `[env]` lock against what is installed, with the install line
  that fixes a mismatch. cuda, nccl and driver are compared only where CUDA devices are present,
  cann only where the toolkit is installed (`$ASCEND_TOOLKIT_HOME`); elsewhere a set key is a
  `skip` row that says why (a lock written for a GPU node does not fail on a laptop).
- `memory_row`, `disk_row`: free device memory against the plan's per-rank estimate, free disk
  against the checkpoints a run keeps.
- `matmul_gflops`, `outliers`: the per-rank matmul throughput probe and its outlier rule.
- `render`: the table, plain aligned text.

Nothing here starts a process group; the multi-rank probes run in `diagnose/probe_worker.py`.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from trainbook.config.book import EnvConfig
from trainbook.monitor.flops import matmul_flops
from trainbook.sizes import human

STATUSES = ("pass", "warn", "fail", "skip")


@dataclass(frozen=True)
class Row:
    check: str
    """What was checked: `torch`, `disk`, `matmul`..."""
    status: str
    """pass | warn | fail | skip."""
    detail: str
    """What was found, one line."""
    fix: str | None = None
    """What to do about a warn or fail, one line (an install line where there is one)."""
    key: str | None = None
    """The recipe key the row answers to (`env.torch`), for errors that name it."""

    def as_dict(self) -> dict:
        return asdict(self)


# ---- the version lock ----------------------------------------------------------------------

def _satisfies(spec: str, found: str) -> bool | None:
    """Whether version `found` satisfies `spec`; None when `found` is not a PEP 440 version.
    Pre-releases count (a nightly torch is what it is)."""
    try:
        return SpecifierSet(spec).contains(Version(found), prereleases=True)
    except InvalidVersion:
        return None


def _pin(spec: str) -> str:
    """What to ask pip for: the specifier as written (`torch==2.13.0`, `numpy>=1.26`)."""
    return spec.replace(" ", "")


def version_row(check: str, spec: str, found: str | None, fix: str, key: str) -> Row:
    """One installed version against its specifier."""
    if found is None:
        return Row(check, "fail", f"not installed; the recipe needs {spec}", fix, key)
    ok = _satisfies(spec, found)
    if ok is None:
        return Row(check, "warn", f"{found} is not a PEP 440 version; cannot compare with {spec}", fix, key)
    if ok:
        return Row(check, "pass", f"{found} satisfies {spec}", key=key)
    return Row(check, "fail", f"{found} does not satisfy {spec}", fix, key)


def installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_line(distribution: str, spec: str) -> str:
    """`pip install 'torch==2.13.0'`: quoted, since `>` and `<` mean something to a shell."""
    return f"pip install '{distribution}{_pin(spec)}'"


def version_rows(env: EnvConfig) -> list[Row]:
    """The `[env]` lock against this machine, one row per key that is set."""
    rows = []
    if env.python:
        found = ".".join(map(str, sys.version_info[:3]))
        rows.append(version_row("python", env.python, found,
                                f"run with a Python {env.python} (this is {sys.executable}, Python {found})",
                                "env.python"))
    if env.torch:
        rows.append(version_row("torch", env.torch, installed("torch"), pip_line("torch", env.torch), "env.torch"))
    rows += _accelerator_rows(env)
    for name, spec in env.packages.items():
        rows.append(version_row(name, spec, installed(name), pip_line(name, spec), f"env.packages.{name}"))
    return rows


def _accelerator_rows(env: EnvConfig) -> list[Row]:
    rows = []
    cuda = torch.cuda.is_available()
    absent = "no CUDA device on this machine: not compared"
    if env.cuda:
        rows.append(version_row("cuda", env.cuda, torch.version.cuda,
                                f"install a torch build for CUDA {env.cuda} "
                                "(https://pytorch.org/get-started/locally/)", "env.cuda")
                    if cuda else Row("cuda", "skip", absent, key="env.cuda"))
    if env.nccl:
        rows.append(version_row("nccl", env.nccl, _nccl_version(),
                                f"install a torch build that bundles NCCL {env.nccl}", "env.nccl")
                    if cuda else Row("nccl", "skip", absent, key="env.nccl"))
    if env.driver:
        rows.append(version_row("driver", env.driver, _nvidia_driver(),
                                f"install an NVIDIA driver {env.driver}", "env.driver")
                    if cuda else Row("driver", "skip", absent, key="env.driver"))
    if env.cann:
        found = _cann_version()
        rows.append(version_row("cann", env.cann, found, f"install the Ascend CANN toolkit {env.cann} and "
                                "source its set_env.sh", "env.cann")
                    if found else Row("cann", "skip", "no CANN toolkit ($ASCEND_TOOLKIT_HOME unset): "
                                      "not compared", key="env.cann"))
    return rows


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _nvidia_driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def _cann_version() -> str | None:
    """The toolkit's version from its version.cfg (`version=8.0.RC2`), as PEP 440 reads it where
    it can (`8.0.RC2` -> `8.0rc2`)."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME")
    if not home:
        return None
    for name in ("version.cfg", "version.info"):
        info = Path(home) / name
        if info.is_file():
            for line in info.read_text(errors="replace").splitlines():
                key, _, value = line.partition("=")
                if key.strip().lower() in ("version", "toolkit_version") and value.strip():
                    return value.strip().strip('"').replace(".RC", "rc").replace(".T", ".dev")
    return "unknown"


# ---- memory and disk ----------------------------------------------------------------------

def free_memory(device: torch.device, nproc: int) -> tuple[int, str]:
    """(bytes free for each of `nproc` ranks, where that came from): the least free accelerator
    of the first `nproc`, or an equal share of the host's available memory on CPU."""
    if device.type in ("cuda", "npu"):
        backend = getattr(torch, device.type)
        free = min(backend.mem_get_info(i)[0] for i in range(min(nproc, backend.device_count())))
        return free, f"least free {device.type} device"
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return available // max(1, nproc), f"host memory available / {nproc} rank{'s' * (nproc > 1)}"


def memory_row(need: int, free: int, source: str) -> Row:
    """The plan's largest per-rank estimate against what each rank has free."""
    detail = f"plan needs ~{human(need)} per rank; {human(free)} free ({source})"
    if need > free:
        return Row("memory", "fail", detail, "free device memory, or shrink the per-rank need "
                   "(`trainbook plan --device-memory` names layouts that fit)")
    if need > 0.8 * free:
        return Row("memory", "warn", detail + f" ({100 * need / free:.0f}% used)",
                   "little headroom: fragmentation or other processes may still run it out of memory")
    return Row("memory", "pass", detail)


def existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def checkpoint_bytes(params: int) -> int:
    """One checkpoint of a model of `params` parameters: fp32 weights and AdamW's two fp32
    moments, 12 bytes a parameter (an upper bound where parameters are frozen), plus 10% for the
    DCP metadata, step counters, loader and RNG state (the default recipe's step-1 checkpoint
    is 22.4 MB for 12 x 1.77M = 21.2 MB of tensors: 1.05x)."""
    return int(12 * params * 1.1)


def disk_row(runs_root: Path, params: int, keep_last: int) -> Row:
    """Free disk under the run archive against `keep_last` checkpoints plus the one being written
    (retention deletes the oldest only after a new one is complete)."""
    where = existing_parent(runs_root)
    free = shutil.disk_usage(where).free
    one = checkpoint_bytes(params)
    need = (keep_last + 1) * one
    detail = (f"{human(free)} free at {where}; {keep_last} kept + 1 in flight x {human(one)} a checkpoint "
              f"= {human(need)}")
    if free < need:
        return Row("disk", "fail", detail, f"free {human(need - free)} there, lower checkpoint.keep_last, "
                   "or set run.runs_root to a larger disk", "checkpoint.keep_last")
    if free < 2 * need:
        return Row("disk", "warn", detail + " (less than twice that)",
                   "logs, metrics and milestones (checkpoint.keep_every) need room too", "checkpoint.keep_last")
    return Row("disk", "pass", detail, key="checkpoint.keep_last")


# ---- the matmul probe ---------------------------------------------------------------------

def matmul_size(device: torch.device) -> int:
    """Square matrix side: large enough to keep an accelerator busy, small enough for a CPU."""
    return 512 if device.type == "cpu" else 8192


def matmul_gflops(device: torch.device, n: int | None = None, inner: int = 8, reps: int = 5,
                  repeat: int = 1) -> float:
    """GFLOP/s of the one matmul probe (monitor/flops.py `matmul_flops`, the probe MFU's CPU peak
    comes from), in fp32 on a CPU and bf16 on an accelerator."""
    dtype = "fp32" if device.type == "cpu" else "bf16"
    return matmul_flops(device, dtype, n or matmul_size(device), inner, reps, repeat) / 1e9


def outliers(rates: list[float]) -> list[int]:
    """Indices of the ranks whose throughput is more than max(MAD, 10% of the median) below the
    median of all ranks (Megatron-LM's straggler sniff test).

    With two ranks the median sits halfway between them and the rule can never fire (the slower
    is exactly one MAD below); there the slower is named when it is more than 10% below the faster.
    """
    if len(rates) < 2:
        return []
    if len(rates) == 2:
        slow, fast = sorted(range(2), key=lambda i: rates[i])
        return [slow] if rates[slow] < 0.9 * rates[fast] else []
    median = statistics.median(rates)
    mad = statistics.median(abs(r - median) for r in rates)
    floor = median - max(mad, 0.1 * median)
    return [i for i, r in enumerate(rates) if r < floor]


def matmul_rows(ranks: list[dict], device_type: str) -> list[Row]:
    """One row for the probe: every rank's GFLOP/s, outliers named by host and rank. A fail on
    accelerators (a slow device holds every step back); a warn on CPU, where the ranks share the
    host's cores and a difference may be another process's load rather than the hardware."""
    rates = [r["gflops"] for r in ranks]
    if len(ranks) == 1:
        return [Row("matmul", "pass", f"{rates[0]:,.1f} GFLOP/s on rank 0 ({ranks[0]['host']})")]
    median = statistics.median(rates)
    # What `outliers` held each rank against: the median, or with two ranks the faster one.
    ref, against = (max(rates), "the faster rank") if len(rates) == 2 else (median, "the median")
    spread = f"median {median:,.1f} GFLOP/s over {len(ranks)} ranks, min {min(rates):,.1f}, max {max(rates):,.1f}"
    slow = outliers(rates)
    if not slow:
        return [Row("matmul", "pass", spread)]
    named = ", ".join(f"rank {ranks[i]['rank']} on {ranks[i]['host']} ({rates[i]:,.1f} GFLOP/s, "
                      f"{100 * (1 - rates[i] / ref):.0f}% below {against})" for i in slow)
    return [Row("matmul", "warn" if device_type == "cpu" else "fail", f"slow: {named}; {spread}",
                "look at what else runs there, and at the device's clocks and temperature "
                "(nvidia-smi -q -d CLOCK,PERFORMANCE on CUDA); or leave that host out of the job")]


# ---- the table ----------------------------------------------------------------------------

def summary(rows: list[Row]) -> dict[str, int]:
    return {s: sum(r.status == s for r in rows) for s in STATUSES}


def render(title: str, rows: list[Row], seconds: float) -> str:
    """Plain aligned text: STATUS  CHECK  what was found, and the fix under each warn or fail."""
    width = max([len(r.check) for r in rows] + [5])
    lines = [title, f"{'STATUS':<7} {'CHECK':<{width}}  RESULT"]
    for r in rows:
        lines.append(f"{r.status.upper():<7} {r.check:<{width}}  {r.detail}")
        if r.fix and r.status in ("warn", "fail"):
            lines.append(f"{'':<7} {'':<{width}}  fix: {r.fix}")
    counts = summary(rows)
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" ({seconds:.1f} s)")
    return "\n".join(lines)
