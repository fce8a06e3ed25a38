"""`trainbook run --nproc N`: resolve and pre-flight once, then start N workers through torchrun.

The workers are PyTorch's own elastic agent (`torch.distributed.run`, with the failure recorder
of commands/elastic.py) running `python -m trainbook run ...` with the same arguments, so a plain
`torchrun -m trainbook run` behaves the same. `--max-restarts K`: when a worker dies the agent
restarts the group and every worker resumes from the newest valid checkpoint; `--nnodes MIN:MAX
--rdzv-endpoint HOST:PORT`: one such launcher per node, meeting at a c10d rendezvous, and a group
that continues on fewer nodes when one is lost. Everything that can fail on user input is checked here first, by the same
resolution and pre-flight a single process runs (layout, config, batch, resume point, data), so a
mistake is one line before any process starts; the data cache, the run directory's name and an
`auto` micro-batch are settled here too, so every rank agrees on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainbook.commands.preflight import check_monitor, gate, prepare_data, resume_point
from trainbook.commands.resolve import resolve
from trainbook.config import load_config
from trainbook.errors import DIAGNOSED, DiagnosedFailure, HangFailure, RepeatedFailure, TrainbookError
from trainbook.monitor.archive import last_attempt, read_jsonl
from trainbook.parallel.device import pick_device
from trainbook.commands.elastic import MONITOR_INTERVAL_S, STOP_GRACE_ENV
from trainbook.parallel.runtime import AGENT_STORE_ENV, free_port
from trainbook.runs import RunPaths, new_run_dir_path

# events.jsonl kinds whose `verdict` stopped the run, and the failure each is
DIAGNOSED_EVENTS = {"oom": DiagnosedFailure, "hang": HangFailure}


def max_processes(device: torch.device) -> int:
    """One process per accelerator; on CPU, up to 4 per core (more only thrashes)."""
    if device.type == "cpu":
        return 4 * (os.cpu_count() or 1)
    return getattr(torch, device.type).device_count()


LAST_CALL_S = 10
"""With `--nnodes MIN:MAX`, how long a rendezvous that has MIN nodes waits for more (torchrun's
default is 30 s): a lost node costs this much of the recovery."""


@dataclass(frozen=True)
class Elastic:
    """How the agent runs the group: restarts, and the nodes of a multi-node run."""

    max_restarts: int = 0
    nnodes: str | None = "1"  # N, or MIN:MAX (None: the recipe's launch.nnodes) (elastic: the group continues on fewer nodes when one is lost)
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous; None: this machine alone
    rdzv_id: str | None = None  # the same on every node; default: the run directory's name

    def node_range(self) -> tuple[int, int]:
        low, _, high = self.nnodes.partition(":")
        try:
            lo, hi = int(low), int(high or low)
        except ValueError:
            raise TrainbookError(f"{self.nnodes!r} is not N or MIN:MAX", where="--nnodes") from None
        if not 1 <= lo <= hi:
            raise TrainbookError(f"{self.nnodes!r}: needs 1 <= MIN <= MAX", where="--nnodes")
        return lo, hi

    def endpoint(self) -> str:
        """The rendezvous endpoint; one machine alone: a free port of its own (torchrun's
        `--standalone`, with a port known to the workers' watchdog)."""
        if self.rdzv_endpoint is not None:
            return self.rdzv_endpoint
        return f"localhost:{free_port()}"

    def torchrun_args(self, run_dir: Path, endpoint: str) -> list[str]:
        lo, hi = self.node_range()
        # Elastic: once MIN nodes have joined, the rendezvous waits this long for the others.
        waits = ["--rdzv-conf", f"last_call_timeout={LAST_CALL_S}"] if lo < hi else []
        return ["--nnodes", f"{lo}:{hi}", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, *waits,
                "--rdzv-id", self.rdzv_id or run_dir.name, "--max-restarts", str(self.max_restarts),
                "--monitor-interval", str(MONITOR_INTERVAL_S)]


def launch(recipe: Path, overrides: list[str], nproc: int, run_dir: Path | None, resume: str,
           check: bool = True, elastic: Elastic = Elastic()) -> int:
    """Resolve and pre-flight once for `nproc` ranks a node, then run them under PyTorch's elastic
    agent (commands/elastic.py); its exit code (errors.py's table)."""
    if "LOCAL_RANK" in os.environ:
        raise TrainbookError("already running under torchrun; drop --nproc", where="--nproc")
    lo, hi = elastic.node_range()
    if hi > 1 and elastic.rdzv_endpoint is None:
        raise TrainbookError("more than one node needs --rdzv-endpoint HOST:PORT (the c10d rendezvous)",
                             where="--nnodes")
    if elastic.rdzv_endpoint is not None and run_dir is None:
        raise TrainbookError("a multi-node run needs --run-dir: one directory every node shares", where="--nnodes")
    device = pick_device(load_config(recipe, overrides).run.device)  # the machine before the layout
    if nproc > max_processes(device):
        raise TrainbookError(f"{nproc} processes, but this machine allows {max_processes(device)} on "
                             f"{device.type} (one per accelerator, 4 per CPU core)", where="--nproc")
    if lo != hi:  # the layout must also hold on the fewest nodes the run may shrink to
        resolve(recipe, overrides, nproc * lo, local_ranks=nproc)
    res = resolve(recipe, overrides, nproc * hi, local_ranks=nproc)
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

    endpoint = elastic.endpoint()
    cmd = [sys.executable, "-m", "trainbook.commands.elastic", str(run_dir), *elastic.torchrun_args(Path(run_dir), endpoint),
           f"--nproc-per-node={nproc}", "-m", "trainbook", "run", str(recipe), *overrides,
           "--run-dir", str(run_dir), "--resume", resume, "--no-check"]  # the gate ran here, once
    if res.cfg.run.threads is None and device.type == "cpu":
        # torchrun would give each worker one thread; share the cores out instead.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Each start of the group gets a store of its own (hosted by its rank 0): the agent's shared
    # store keeps the keys of the group before a restart, and gloo would connect to dead ranks.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[AGENT_STORE_ENV] = endpoint  # the watchdog's store, which outlives every worker
    os.environ[STOP_GRACE_ENV] = str(res.cfg.parallel.stop_grace_s)
    began = time.time()
    proc = subprocess.Popen(cmd)
    # Pre-emption reaches this process first: hand it on (the agent forwards it to the workers).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    code = proc.wait()
    if code == 0:
        return 0
    # torchrun exits 1 whatever its workers' codes were. Restarts spent: the repeated-failure
    # verdict. A run that stopped on a failure it diagnosed says so in events.jsonl: rank 0
    # printed the verdict (its end event), or was stopped by torchrun before it could (the failing
    # rank's own event): exit as one process would.
    events = read_jsonl(RunPaths.of(run_dir).events)
    failed = [e for e in events if e.get("kind") == "worker_failed" and e.get("time", 0) >= began]
    said, diagnosis = _diagnosis(events)
    if elastic.max_restarts > 0 and len(failed) > elastic.max_restarts:
        raise RepeatedFailure(repeated_failure(failed, elastic.max_restarts, diagnosis))
    if said is not None:
        return said.exit_code
    if diagnosis is not None:
        raise diagnosis
    return code


def _diagnosis(events: list[dict]) -> tuple[type[DiagnosedFailure] | None, DiagnosedFailure | None]:
    """(the diagnosed failure rank 0 ended on and printed, the failure of a diagnosed failure
    event) of the run's last attempt."""
    attempt = last_attempt(events)
    said = None
    for e in attempt:
        name = str(e.get("error") or "").partition(":")[0] if e.get("kind") == "end" else ""
        said = DIAGNOSED.get(name, said)
    failure = next((DIAGNOSED_EVENTS[e["kind"]](e["verdict"]) for e in reversed(attempt)
                    if e.get("kind") in DIAGNOSED_EVENTS), None)
    return said, failure


def _who(e: dict) -> str:
    how = f"killed by {e['signal']}" if e.get("signal") else f"exit code {e.get('exit_code')}"
    return f"rank {e.get('rank') if e.get('rank') is not None else '?'} ({how})"


def repeated_failure(failed: list[dict], max_restarts: int, diagnosis: DiagnosedFailure | None) -> str:
    """The verdict of an elastic run whose restarts are spent."""
    steps = [e.get("step") for e in failed]
    if len(set(steps)) == 1:
        whos = sorted({_who(e) for e in failed})
        where = f"step {steps[0]}" if steps[0] is not None else "the start-up (before the first step)"
        head = (f"{where} failed {len(failed)} times in a row ({', '.join(whos)}"
                f"{' each time' if len(whos) == 1 else ''}): a failure that repeats")
    else:
        head = f"the run failed {len(failed)} times (" + "; ".join(
            f"{'step ' + str(e['step']) if e.get('step') is not None else 'start-up'}: {_who(e)}" for e in failed) + ")"
    last = f"; the last: {diagnosis.message}" if diagnosis is not None else ""
    return (f"{head}; the {max_restarts} restarts of --max-restarts are spent{last}; see the worker_failed "
            f"and restart events in events.jsonl, fix the cause, then `trainbook run --run-dir RUN` continues")
