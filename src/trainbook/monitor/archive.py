"""A run directory read back: resolved config, env, metrics, events, layer statistics, status.

What `report`, `compare` and `runs` know about a run comes only from its files (DESIGN.md, "Run
directory"). Files written by a run that is still going, or that died mid-line, are read
leniently: a line that is not JSON is skipped, a missing optional file is an empty list.

How the status is decided (the last attempt is the one after the last `start` or `resume` event):

- `finished`, `stopped`, `failed`: the trainer's end marker, an `end` event with that status,
  written when `fit` returns or raises (the error is in its `error` field);
- `running`: no end marker, and the attempt's process (the `pid` and `host` of its `start` or
  `resume` event) is alive on this host and is a trainbook process;
- `unknown`: no end marker and the attempt ran on another host: it may be running there;
- `died`: no end marker and no such process: killed by SIGKILL or the OOM killer, or the machine
  went down. Nothing in the files can tell these apart.

Runs written before end markers existed fall back on what they did leave: a `stopped` event is
`stopped`, a final checkpoint at `train.max_steps` is `finished`, anything else `unknown` (such
a run recorded no process id either, so a live one cannot be told from a dead one).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from trainbook.errors import TrainbookError
from trainbook.model.families import config_as_built
from trainbook.runs import RunPaths


@dataclass
class RunRecord:
    path: Path
    config: dict
    """config.resolved.toml as a tree, with train.compile and train.loss as the run settled them."""
    env: dict = field(default_factory=dict)
    train: list[dict] = field(default_factory=list)
    """metrics.jsonl train lines, by step."""
    evals: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    experts: list[dict] = field(default_factory=list)
    """experts.jsonl lines, by step (a mixture of experts' load; none for a dense model)."""
    checkpoints: list[str] = field(default_factory=list)
    status: str = "unknown"
    status_detail: str = ""

    @property
    def name(self) -> str:
        return str(self.config.get("run", {}).get("name") or self.path.name)

    @property
    def max_steps(self) -> int | None:
        return self.config.get("train", {}).get("max_steps")

    @property
    def started(self) -> float | None:
        """When the run started: its first event, else env.json's capture time."""
        times = [e["time"] for e in self.events if isinstance(e.get("time"), (int, float))]
        return times[0] if times else self.env.get("time")

    @property
    def steps(self) -> int:
        """The last step the files know of: a train line, or an event (a checkpoint, the end)."""
        known = [r["step"] for r in self.train] + [e.get("step", 0) for e in self.events if e.get("kind") != "alert"]
        return max((s for s in known if isinstance(s, int)), default=0)

    @property
    def final_loss(self) -> float | None:
        return self.train[-1].get("loss") if self.train else None

    @property
    def final_val_loss(self) -> float | None:
        return self.evals[-1].get("val_loss") if self.evals else None

    @property
    def tokens_per_s(self) -> float | None:
        """The median over logged steps: the first steps (warm-up, compilation) do not dominate."""
        values = [r["tokens_per_s"] for r in self.train if isinstance(r.get("tokens_per_s"), (int, float))]
        return statistics.median(values) if values else None

    @property
    def tokens_per_step(self) -> float | None:
        for r in reversed(self.train):
            if r.get("step") and isinstance(r.get("tokens"), (int, float)):
                return r["tokens"] / r["step"]
        starts = [e["tokens_per_step"] for e in self.events if e.get("kind") == "start" and "tokens_per_step" in e]
        return starts[-1] if starts else None

    def config_value(self, dotted: str):
        """The resolved value of `optim.lr`-style keys; None when the run's config has no such key."""
        node = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


def is_run_dir(path: Path) -> bool:
    """A run directory is one with its resolved config."""
    return RunPaths.of(path).config.is_file()


def load_run(path: str | Path, *, need_metrics: bool = True) -> RunRecord:
    """Read a run directory; a path that is not one (or lacks metrics.jsonl when `need_metrics`)
    is a user error naming it."""
    paths = RunPaths.of(path)
    if not paths.root.is_dir():
        raise TrainbookError("no such run directory", where=str(paths.root))
    if not is_run_dir(paths.root):
        raise TrainbookError(f"not a run directory (no {paths.name(paths.config)})", where=str(paths.root))
    if need_metrics and not paths.metrics.is_file():
        raise TrainbookError("missing file: the run has no metrics to show", where=str(paths.metrics))
    try:
        config = tomllib.loads(paths.config.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TrainbookError(f"not valid TOML: {e}", where=str(paths.config)) from None
    config = config_as_built(config)  # a run from before the family options: as it was built
    # `auto` as the run settled it (parallel/compile.py keeps the choice in workers/compile.json).
    settled = _read_json(paths.workers / "compile.json")
    if "compile" in settled and "loss" in settled:
        config.setdefault("train", {}).update(compile=settled["compile"], loss=settled["loss"])
    metrics = read_jsonl(paths.metrics)
    run = RunRecord(
        path=paths.root, config=config, env=_read_json(paths.env),
        train=_by_step([m for m in metrics if m.get("kind") == "train"]),
        evals=_by_step([m for m in metrics if m.get("kind") == "eval"]),
        events=read_jsonl(paths.events), layers=_by_step(read_jsonl(paths.layers)),
        experts=_by_step(read_jsonl(paths.experts)),
        checkpoints=_checkpoints(paths.checkpoints),
    )
    run.status, run.status_detail = run_status(run)
    return run


def find_runs(root: Path) -> list[Path]:
    """Every run directory under `root` (a run's own subdirectories are not searched)."""
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if is_run_dir(here):
            found.append(here)
            dirnames.clear()
        else:
            dirnames.sort()
    return sorted(found)


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSON-lines file; a line cut short by a crash (or any non-object) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def last_attempt(events: list[dict]) -> list[dict]:
    """The events from the last `start` or `resume` on: what the run's latest attempt wrote
    (all of them when there is neither)."""
    starts = [i for i, e in enumerate(events) if e.get("kind") in ("start", "resume")]
    return events[starts[-1]:] if starts else events


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _by_step(records: list[dict]) -> list[dict]:
    """Records with an integer step, in step order; a step written twice keeps its last line."""
    by_step = {r["step"]: r for r in records if isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def _checkpoints(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted((p.name for p in folder.glob("step-*") if p.is_dir()), key=lambda n: int(n[5:]) if n[5:].isdigit() else -1)


# ---- status ---------------------------------------------------------------------------------


def run_status(run: RunRecord) -> tuple[str, str]:
    """(status, detail): see the module docstring for how each is decided."""
    attempt = last_attempt(run.events)
    ends = [e for e in attempt if e.get("kind") == "end"]
    if ends:
        end = ends[-1]
        status = end.get("status") if end.get("status") in ("finished", "stopped", "failed") else "unknown"
        detail = end.get("error") or (f"at step {end.get('step')}" if "step" in end else "")
        return status, str(detail)
    opened = attempt[0] if attempt and attempt[0].get("kind") in ("start", "resume") else {}
    pid, host = opened.get("pid"), opened.get("host")
    if isinstance(pid, int) and host:
        if host != socket.gethostname():
            return "unknown", f"no end marker; ran on host {host}"
        if _trainbook_alive(pid):
            return "running", f"pid {pid}"
    stopped = [e for e in attempt if e.get("kind") == "stopped"]
    if stopped:
        return "stopped", f"by {stopped[-1].get('signal', 'a signal')} at step {stopped[-1].get('step')}"
    if run.max_steps and f"step-{run.max_steps}" in run.checkpoints:
        return "finished", "final checkpoint present (no end marker)"
    if not (isinstance(pid, int) and host):
        return "unknown", "no end marker and no process id (written before either existed)"
    return "died", "no end marker and no live process (killed, or the machine went down)"


def _trainbook_alive(pid: int) -> bool:
    """A live process with this pid that runs trainbook (a pid reused by another program is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():
        return True  # no /proc to ask: trust the pid
    try:
        return b"trainbook" in cmdline.read_bytes()
    except OSError:
        return False
