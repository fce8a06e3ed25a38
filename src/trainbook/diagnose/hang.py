"""The hang watchdog: when no rank advances, say who waits for whom, with every rank's stacks.

One thread per rank. Every tick (a tenth of `parallel.hang_timeout_s`, 0.2-5 s) it publishes
what its rank is doing to the rendezvous store (torchrun's agent keeps it alive whatever happens
to a worker): the phase tracker's step, phase and entry time, the collective sequence numbers of
each process group (c10d's flight recorder: last enqueued and last completed, parallel/flight.py),
and a heartbeat. Then it reads every rank's record.

A rank *advances* when its step, phase or collective counters change. A hang is declared when
no rank has advanced for `hang_timeout_s` (judged on this rank's clock, from what it reads: no
clock is compared across hosts) while some rank waits in a collective. Every rank computing for
a long time (a slow first compile, a long save) is slow, not hung, and is left to the alerts.

Then, before anything is killed (the collective timeout is longer, by validation):
1. every rank that can still run Python writes its stacks to `hang/rank<R>.txt` (faulthandler,
   plus `py-spy dump` when installed), its flight-recorder buffer to `hang/fr/rank<R>`, and
   reports to the store what it is doing and which collectives it has in flight;
2. after every rank has reported, or `REPORT_WINDOW_S`, the lowest rank that reported speaks:
   a rank that did not report cannot run Python (stopped, in a kernel, in a C call that holds the
   GIL): it is named from its last published record, its stacks are taken from outside
   (`py-spy dump --nonblocking --pid`, same host only; without py-spy its record is all there
   is, and the verdict says so) and it is killed;
3. the speaker writes `hang/verdict.txt` and `hang/verdict.json`, the `hang` and `end` events,
   prints `trainbook: error: <verdict>`, and every live rank exits with code 4 (a diagnosed
   failure): torchrun's agent sees the failure and an elastic restart can follow.

The main thread may be blocked inside a collective, in C++, where no exception can reach it:
the watchdog ends the process itself, as the CLI would for a `HangFailure`.

Only with more than one process: one process has no collective to hang in (a stalled loop is
the stall alert's to report).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from trainbook.atomic import atomic_write_json, atomic_write_text
from trainbook.errors import HangFailure
from trainbook.monitor import EventLog
from trainbook.phase import Phase, PhaseTracker
from trainbook.runs import RunPaths

REPORT_WINDOW_S = 10.0
"""How long the live ranks wait for every rank's report before naming the silent ones."""
SPEAKER_WAIT_S = 30.0
"""How long a live rank that does not speak waits for the speaker before exiting anyway."""
EXIT_CODE = HangFailure.exit_code

# What a rank is doing, in the verdict's words.
DOING = {Phase.DATA.value: "data loading", Phase.IDLE.value: "between steps",
         Phase.GRAD_SYNC.value: "gradient sync", Phase.EVALUATION.value: "evaluation",
         Phase.CHECKPOINT.value: "checkpointing"}


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this Python (a virtual environment's bin)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def stacks_from_outside(pid: int, timeout_s: float = 20.0) -> str | None:
    """`py-spy dump` of another process, without stopping it (it may already be stopped)."""
    exe = py_spy()
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


class HangWatchdog:
    def __init__(self, *, store, rank: int, world_size: int, tracker: PhaseTracker, paths: RunPaths,
                 timeout_s: float, backend: str, logger: logging.Logger,
                 collectives: Callable[[], dict], in_flight: Callable[[], list[dict]],
                 dump_trace: Callable[[Path], bool], analyse: Callable[[Path, str], str | None]):
        """`store`: a store every rank reaches (parallel.runtime.watch_store); `paths`: the run's,
        whose `hang/` it writes and whose events.jsonl gets the `hang` and `end` events;
        `collectives`, `in_flight`, `dump_trace`, `analyse`: the flight recorder's readings
        (parallel/flight.py)."""
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.tracker = tracker
        self.paths = paths
        self.timeout_s = timeout_s
        self.tick_s = min(5.0, max(0.2, timeout_s / 10))
        self.backend = backend
        self.logger = logger
        self.collectives, self.in_flight, self.dump_trace, self.analyse = collectives, in_flight, dump_trace, analyse
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainbook-hang-watchdog", daemon=True)
        self._beat = 0
        self.exit: Callable[[int], None] = os._exit  # the process ends here once the verdict is out

    def start(self) -> HangWatchdog:
        # The first record before the thread's first tick: a rank that stops a moment after
        # starting (before a tick has passed) is still known to the others, and named from it.
        self.store.set(f"state/{self.rank}", json.dumps(self._record()))
        self._thread.start()
        return self

    def close(self) -> None:
        """This rank is done with collectives: stop, and tell the others to stop judging."""
        self._stop.set()
        self._thread.join(timeout=2 * self.tick_s + 5)
        try:
            self.store.add("closed", 1)
        except Exception:  # noqa: BLE001 - the agent's store may already be gone at the end
            pass

    # ---- every tick ----------------------------------------------------------------------

    def _record(self) -> dict:
        s = self.tracker.current()
        self._beat += 1
        return {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": s.step, "phase": s.phase.value,
                "detail": s.detail, "since": s.since, "collectives": self.collectives(), "beat": self._beat}

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as e:  # noqa: BLE001 - the watchdog must never take training down
            self.logger.warning(f"hang watchdog stopped: {type(e).__name__}: {e}")

    def _watch(self) -> None:
        keys = [f"state/{r}" for r in range(self.world_size)]
        last: dict | None = None  # every rank's progress, as last seen
        changed = time.monotonic()  # when any rank last advanced (this rank's clock)
        while not self._stop.wait(self.tick_s):
            self.store.set(f"state/{self.rank}", json.dumps(self._record()))
            if self.store.check(["declared"]):
                return self._on_hang()
            if not self.store.check(keys) or self.store.add("closed", 0) > 0:
                changed = time.monotonic()  # not every rank watches (yet, or any more)
                continue
            states = [json.loads(v) for v in self.store.multi_get(keys)]
            progress = [(s["step"], s["phase"], s["detail"], s["since"], s["collectives"]) for s in states]
            now = time.monotonic()
            if progress != last:
                last, changed = progress, now
                continue
            if now - changed >= self.timeout_s and any(_waiting(s) for s in states):
                self.store.compare_set("declared", "", json.dumps({"by": self.rank, "after_s": now - changed}))
                return self._on_hang()

    # ---- once a hang is declared -----------------------------------------------------------

    def _on_hang(self) -> None:
        declared = json.loads(self.store.get("declared"))
        self.paths.hang.mkdir(parents=True, exist_ok=True)
        report = {**self._record(), "in_flight": self.in_flight(), "stacks": self._write_own_stacks()}
        (self.paths.hang / "fr").mkdir(exist_ok=True)
        self.dump_trace(self.paths.hang / "fr" / f"rank{self.rank}")
        self.store.set(f"report/{self.rank}", json.dumps(report))
        self.logger.error(f"hang declared (no rank advanced for {self.timeout_s:g} s); this rank is in "
                          f"step {report['step']}, {report['phase']}; stacks in {report['stacks']}")
        deadline = time.monotonic() + REPORT_WINDOW_S
        while time.monotonic() < deadline and len(self._reporters()) < self.world_size:
            time.sleep(0.1)
        # The first rank to close the window fixes who reported: every rank then agrees on the speaker.
        reporters = json.loads(self.store.compare_set("reporters", "", json.dumps(self._reporters())))
        if self.rank == min(reporters):
            try:
                self._speak(reporters, declared)
            finally:
                self.store.set("spoken", "1")
        else:
            deadline = time.monotonic() + SPEAKER_WAIT_S
            while time.monotonic() < deadline and not self.store.check(["spoken"]):
                time.sleep(0.1)
        for handler in self.logger.handlers:
            handler.flush()
        sys.stdout.flush(), sys.stderr.flush()
        self.exit(EXIT_CODE)

    def _reporters(self) -> list[int]:
        return [r for r in range(self.world_size) if self.store.check([f"report/{r}"])]

    def _write_own_stacks(self) -> str:
        """This process's Python stacks, every thread: faulthandler (always), py-spy (when installed)."""
        path = self.paths.hang / f"rank{self.rank}.txt"
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"rank {self.rank} (host {self.host}, pid {os.getpid()}): Python stacks by faulthandler\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        outside = stacks_from_outside(os.getpid())
        if outside:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"\npy-spy dump --pid {os.getpid()}\n\n{outside}")
        return self.paths.name(path)

    def _speak(self, reporters: list[int], declared: dict) -> None:
        states = {r: json.loads(v) for r, v in zip(range(self.world_size), self.store.multi_get(
            [f"state/{r}" for r in range(self.world_size)]))}
        reports = {r: json.loads(self.store.get(f"report/{r}")) for r in reporters}
        silent = {}
        for r in range(self.world_size):
            if r not in reports:
                silent[r] = self._outside(states[r])
        verdict = explain(reports, {r: states[r] for r in silent}, silent, self.timeout_s)
        if self.backend == "nccl":
            analysis = self.analyse(self.paths.hang / "fr", "rank")
            if analysis:
                atomic_write_text(self.paths.hang / "flight_recorder.txt", analysis)
        verdict["after_s"] = round(declared.get("after_s", self.timeout_s), 3)
        # Its stacks are on disk: a rank that cannot speak will not exit by itself either.
        verdict["killed"] = [r for r in silent if r not in self._reporters() and states[r]["host"] == self.host
                             and _kill(states[r]["pid"])]
        atomic_write_text(self.paths.hang / "verdict.txt", verdict["verdict"] + "\n")
        atomic_write_json(self.paths.hang / "verdict.json", verdict, indent=2)
        events = EventLog(self.paths.events)
        try:
            events.emit("hang", verdict["step"], verdict=verdict["verdict"],
                        stuck_ranks=[s["rank"] for s in verdict["stuck"]],
                        dir=self.paths.name(self.paths.hang))
            events.emit("end", verdict["step"], status="failed", error=f"HangFailure: {verdict['verdict']}")
        finally:
            events.close()
        print(f"trainbook: error: {HangFailure(verdict['verdict'])}", file=sys.stderr, flush=True)

    def _outside(self, state: dict) -> str | None:
        """Stacks of a rank that cannot speak, from outside; the file, or None."""
        if state["host"] != self.host:
            return None
        text = stacks_from_outside(state["pid"])
        if text is None:
            return None
        path = self.paths.hang / f"rank{state['rank']}.txt"
        atomic_write_text(path, f"rank {state['rank']} (host {state['host']}, pid {state['pid']}): it could not "
                                f"run Python; stacks taken from outside by py-spy dump --nonblocking\n\n{text}")
        return self.paths.name(path)


def _waiting(state: dict) -> bool:
    """Whether a rank's record shows it inside a collective (completed unknown: assume so)."""
    return any(done is None or enq > done for enq, done in state["collectives"].values())


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
        return True
    except OSError:
        return False


def _doing(state: dict) -> str:
    phase = DOING.get(state["phase"], state["phase"])
    return f"{phase} ({state['detail']})" if state.get("detail") else phase


def _ranks(ranks: list[int]) -> str:
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(map(str, ranks))


def explain(reports: dict[int, dict], silent_states: dict[int, dict], silent_stacks: dict[int, str | None],
            timeout_s: float) -> dict:
    """The verdict (verdict.json's fields) from the live ranks' reports and the last published
    records of the ranks that could not speak."""
    # The collective the waiting ranks are in: the one most of them have in flight (their first).
    firsts = Counter((f["pg"], f["seq"], f["op"], f["group"]) for rep in reports.values() for f in rep["in_flight"][:1])
    collective = firsts.most_common(1)[0][0] if firsts else None
    every = {**reports, **silent_states}
    waiting, stuck = [], []
    for r in sorted(every):
        s = every[r]
        if collective is not None and r in reports and any(
                (f["pg"], f["seq"]) == collective[:2] for f in s["in_flight"]):
            waiting.append(r)
        elif collective is not None and r in silent_states and _in(s, collective):
            waiting.append(r)
        else:
            stuck.append(r)
    name = None if collective is None else f"{collective[2]} #{collective[1]}" + (
        "" if collective[3] in ("default_pg", "0", "") else f" (group {collective[3]})")
    parts = []
    if waiting:
        w = every[waiting[0]]
        parts.append(f"{_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''} in {name} "
                     f"(step {w['step']}, {_doing(w)})")
    for r in stuck:
        s = every[r]
        where = f"rank {r} (host {s['host']}"
        if collective is None:
            reached = "is not in a collective"
        else:
            mine = s["collectives"].get(collective[0], [None, None])[0]
            other = s.get("in_flight", [])[:1]
            if other:
                o = other[0]
                reached = f"never reached it, it waits in {o['op']} #{o['seq']} instead"
            elif mine is not None and mine >= collective[1]:
                reached = "has left it"
            else:
                reached = "never reached it"
        if r in reports:
            parts.append(f"{where}) {reached}: it is in {_doing(s)} of step {s['step']}, stack in {s['stacks']}")
        else:
            stacks = silent_stacks.get(r)
            tail = f"stack taken from outside in {stacks}" if stacks else (
                "no stack: py-spy is not installed (or the rank is on another host); its last published "
                "state is all there is" if s["host"] != socket.gethostname() or py_spy() is None else
                "no stack: py-spy could not read it; its last published state is all there is")
            # Its record is the last one it published, up to a tick before it fell silent.
            parts.append(f"{where}, pid {s['pid']}) cannot speak (stopped, in a kernel, or in a C call that "
                         f"holds the GIL) and {reached.replace('never reached', 'had not reached')} when last "
                         f"heard from ({_doing(s)} of step {s['step']}); {tail}")
    if not parts:
        parts.append(f"no rank advanced for {timeout_s:g} s")
    stuck_info = [{"rank": r, "host": every[r]["host"], "pid": every[r]["pid"], "phase": every[r]["phase"],
                   "step": every[r]["step"],
                   "stacks": every[r]["stacks"] if r in reports else silent_stacks.get(r),
                   "speaks": r in reports} for r in stuck]
    first = every[waiting[0]] if waiting else every[min(every)]
    return {"step": first["step"], "collective": None if collective is None else collective[2],
            "seq": None if collective is None else collective[1],
            "group": None if collective is None else collective[3],
            "waiting": waiting, "stuck": stuck_info, "silent": sorted(silent_states), "timeout_s": timeout_s,
            "verdict": "; ".join(parts)}


def _in(state: dict, collective: tuple) -> bool:
    """A silent rank's last record has `collective` enqueued and not completed."""
    enq, done = state["collectives"].get(collective[0], [None, None])
    return enq is not None and enq >= collective[1] and (done is None or done < collective[1])


def start_hang_watchdog(hang_timeout_s: float, rt, tracker: PhaseTracker, paths: RunPaths,
                        logger: logging.Logger) -> HangWatchdog | None:
    """The watchdog of this rank (`rt`: parallel.runtime.Runtime) over the run `paths`, started;
    None in one process or with `hang_timeout_s` 0."""
    if not rt.distributed or hang_timeout_s <= 0:
        return None
    from trainbook.parallel import flight
    from trainbook.parallel.runtime import BACKENDS, watch_store

    return HangWatchdog(
        store=watch_store("trainbook/hang"), rank=rt.rank, world_size=rt.world_size, tracker=tracker,
        paths=paths, timeout_s=hang_timeout_s, backend=BACKENDS[rt.device.type], logger=logger,
        collectives=flight.status, in_flight=flight.in_flight, dump_trace=flight.dump, analyse=flight.analyse,
    ).start()
