"""The elastic agent: PyTorch's own (`torch.distributed.run`, torchrun), with a failure recorder.

`python -m trainbook.commands.elastic RUN_DIR [torchrun arguments...]` is torchrun, unchanged,
plus one logging handler: when the agent finds a failed worker (torchrun logs the first failure
of the group with its exit code, local rank and pid, then stops the others and restarts the
group or gives up), the recorder appends a `worker_failed` event to RUN_DIR/events.jsonl (who:
the global rank, from the worker's own `workers/rank<R>.json`; the exit code or signal; the step
it failed in, from health.json) and sets health.json's state to `restarting`, or `failed` when no
restart is left. Only the agent sees a worker's exit status, a SIGKILL included: the worker
cannot report its own death. The next attempt's rank 0 turns these into its `restart` event
(`restart_event`), and the launcher its final verdict (`repeated_failure`).

The rest is torchrun's: rendezvous (c10d, `--nnodes MIN:MAX`), restarts (`--max-restarts`),
signals forwarded to the workers, the failure summary on stderr.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from trainbook.monitor.archive import last_attempt
from trainbook.monitor.health import attempt, read_health, write_health
from trainbook.runs import RunPaths

MONITOR_INTERVAL_S = 0.5
"""How often the agent polls its workers (torchrun's `--monitor-interval`; its default is 0.1)."""
FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"
FAILURE_MESSAGE = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"  # torch 2.13


def signal_name(exit_code: int | None) -> str | None:
    """`SIGKILL` for a process killed by signal 9 (a negative exit code, as Popen reports it)."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def write_worker_file(run_dir: Path) -> None:
    """`workers/rank<R>.json`: who this worker is, for the agent's recorder to name it."""
    folder = RunPaths.of(run_dir).workers
    folder.mkdir(exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "group_rank": int(os.environ.get("GROUP_RANK", "0")), "host": socket.gethostname(),
              "pid": os.getpid(), "attempt": attempt(), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    tmp = folder / f".rank{rank}.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, folder / f"rank{rank}.json")


def _worker_by_pid(workers: Path, pid: int) -> dict:
    for path in workers.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("pid") == pid:
            return record
    return {}


class FailureRecorder(logging.Handler):
    """Takes torchrun's "failed (exitcode ...)" record; writes the `worker_failed` event."""

    def __init__(self, paths: RunPaths, max_restarts: int):
        super().__init__(level=logging.ERROR)
        self.paths = paths
        self.max_restarts = max_restarts
        self.failures = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg != FAILURE_MESSAGE or not isinstance(record.args, tuple) or len(record.args) != 4:
            return
        try:
            self.record(*record.args[:3])
        except Exception as e:  # noqa: BLE001 - the recorder must never take the agent down
            print(f"trainbook: warning: could not record a worker failure: {e}", file=sys.stderr)

    def record(self, exit_code: int, local_rank: int, pid: int) -> None:
        self.failures += 1
        if not self.paths.root.is_dir():  # it failed before the run directory existed
            return
        worker = _worker_by_pid(self.paths.workers, pid)
        health = read_health(self.paths.health)
        step = int(health.get("step", 0))
        done = step - 1 if health.get("phase") not in (None, "idle") else step  # the last step recorded
        starting = health.get("state") in (None, "starting")  # before this attempt's first step
        restarting = self.failures <= self.max_restarts
        event = {"kind": "worker_failed", "step": None if starting else done + 1, "time": time.time(),
                 "rank": worker.get("rank"), "local_rank": local_rank, "host": worker.get("host", socket.gethostname()),
                 "pid": pid, "exit_code": exit_code, "signal": signal_name(exit_code),
                 "attempt": worker.get("attempt"), "last_step_done": None if starting else done,
                 "then": "restart" if restarting else "give up"}
        with open(self.paths.events, "a", encoding="utf-8") as f:  # one O_APPEND write
            f.write(json.dumps(event) + "\n")
        if health:
            write_health(self.paths.health, {**health, "state": "restarting" if restarting else "failed"})


def _max_restarts(args: list[str]) -> int:
    for i, a in enumerate(args):
        if a.startswith("--max-restarts") or a.startswith("--max_restarts"):
            return int(a.partition("=")[2] or args[i + 1])
    return 0


def main(argv: list[str]) -> None:
    paths, args = RunPaths.of(argv[0]), argv[1:]
    logging.getLogger(FAILURE_LOGGER).addHandler(FailureRecorder(paths, _max_restarts(args)))
    from torch.distributed.elastic.rendezvous import api as rendezvous_api
    from torch.distributed.run import main as torchrun

    from trainbook.parallel.runtime import free_port

    # Each start of the group gets a store of its own (commands/launch.py), on a port the agent
    # picks for its rank 0. torch picks it by binding port 0, an ephemeral port, which any
    # outgoing connection on the machine (another job's gloo) may take before rank 0 binds it:
    # that start then fails with EADDRINUSE and costs a restart (seen in CI). Outside the
    # ephemeral range only another explicit bind can take it.
    rendezvous_api.get_free_port = free_port
    _stop_with_grace(float(os.environ.get(STOP_GRACE_ENV, "30")))
    torchrun(args)


STOP_GRACE_ENV = "TRAINBOOK_STOP_GRACE_S"
"""`parallel.stop_grace_s`, from the launcher (commands/launch.py) to the agent here."""


def _stop_with_grace(grace_s: float) -> None:
    """The agent stops its workers (a failure, a restart, a signal) with SIGTERM, then SIGKILL
    after a timeout: 30 s wherever torch 2.13 closes its workers' processes (`PContext.close`,
    whose callers mostly leave the default), with no option of torchrun's to change it."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_with_grace(self, death_sig: signal.Signals | None = None, timeout: float = grace_s) -> None:
        close(self, death_sig, grace_s)

    PContext.close = close_with_grace


if __name__ == "__main__":
    main(sys.argv[1:])


LINGER_S = 4 * MONITOR_INTERVAL_S
"""How long a worker whose peer vanished waits before it exits (see `linger_if_peer_lost`)."""
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def linger_if_peer_lost(error: BaseException) -> None:
    """A collective failed because a peer vanished: wait for the agent's SIGTERM (or `LINGER_S`).

    The agent reports the first failure it sees at a poll; a survivor that exited at once would
    often be seen dead at the same poll as the worker that really died, and be named instead
    (torchrun breaks the tie by local rank). Lingering lets the real failure surface first; a
    peer on another node (whose agent restarts the group) costs this much recovery time."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not any(m in str(error) for m in PEER_LOST):
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's SIGTERM ends it at once
    time.sleep(LINGER_S)


def process_started() -> float | None:
    """The wall-clock time this process started (Linux /proc), or None where it cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # since boot
        booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return booted + ticks / os.sysconf("SC_CLK_TCK")


def is_restart() -> bool:
    """Whether this worker is the agent's restart of a failed group (not the first attempt)."""
    return attempt() > 0


def restart_event(events: list[dict], resumed_step: int, world_size: int) -> dict | None:
    """The `restart` event of this attempt: the previous attempt's failures (the recorder's
    `worker_failed` events since it started), the steps they cost, the world it continues on.
    None when this attempt follows no failure, no restart and no change of the world size (a
    plain start or resume; a node that rejoined restarts the group without a failure)."""
    before = last_attempt(events)
    failed = [e for e in before if e.get("kind") == "worker_failed"]
    previous = before[0].get("world_size") if before and before[0].get("kind") in ("start", "resume") else None
    if not failed and not is_restart() and previous in (None, world_size):
        return None  # a plain start or resume; a new world size is a membership change
    done = max((e["last_step_done"] for e in failed if e.get("last_step_done") is not None), default=resumed_step)
    return {
        "attempt": attempt(),
        "failed": [{k: e.get(k) for k in ("rank", "host", "exit_code", "signal", "step")} for e in failed],
        "failed_step": failed[0].get("step") if failed else None,
        "resumed_step": resumed_step, "steps_lost": max(0, done - resumed_step),
        "world_size": world_size, "previous_world_size": previous,
        "down_s": round(time.time() - failed[0]["time"], 3) if failed else None,
        "process_started": process_started(),  # this worker's start: its start-up is the restart's cost
    }


def restart_line(event: dict) -> str:
    """The log line of a `restart` event."""
    who = ", ".join(f"rank {f['rank']} ({f['signal'] or 'exit code ' + str(f['exit_code'])})" for f in event["failed"])
    world = event["world_size"]
    size = (f" on {world} ranks (was {event['previous_world_size']})" if event["previous_world_size"] not in (None, world)
            else f" on {world} ranks")
    failed = f"{who} failed in step {event['failed_step']}; " if event["failed"] else ""
    lost = event["steps_lost"]
    return (f"restart {event['attempt']}: {failed}resumed from step {event['resumed_step']} "
            f"({lost} step{'' if lost == 1 else 's'} lost){size}")
