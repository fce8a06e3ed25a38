"""Fault points: named places where a test causes a real failure at an exact moment.

`TRAINBOOK_FAULT=<point>@<step>` arms one point at one step; `<point>@<step>+` at that step and
every later one; a bare `<point>` at every step. Several points: a comma-separated list
(`model.block_nan@5,train.leak`). `TRAINBOOK_FAULT_RANK=<r>` limits them to one rank. An item may
carry its own qualifiers: `:r<R>` (rank R only) and `:a<A>` (elastic attempt A only: the
agent's restart count, `TORCHELASTIC_RESTART_COUNT`, 0 before any restart), so one list kills
rank 1 at step 7 of the first attempt and rank 0 at step 13 of the next
(`train.after_step@7:r1:a0,train.after_step@13:r0:a1`); without `:a` a point fires in every
attempt (a failure that repeats). Unset, a point costs one environment lookup.

Two kinds of point:

- Stops, `fault_point(point, step)`: by default the process sends itself a real SIGKILL there.
  `TRAINBOOK_FAULT_ACTION=hang` makes it stop answering instead (collective timeouts);
  `TRAINBOOK_FAULT_ACTION=stop` sends it a real SIGSTOP (a rank that cannot speak at all: no
  thread of it runs, as if stopped in a debugger or wedged in the kernel; hang diagnosis);
  `TRAINBOOK_FAULT_ACTION=raise` raises a RuntimeError there (a run that fails with a Python error);
  `TRAINBOOK_FAULT_ACTION=wait` blocks it until the file named by `TRAINBOOK_FAULT_RELEASE`
  exists (or a SIGTERM arrives, which then stops the run as usual), so a test holds a run stuck
  exactly as long as it needs (stall alerts, hang diagnosis, a node rejoining) and then lets it
  go on. Crash-safety tests use them to die at moments (between a
  checkpoint's manifest and its rename, after a given step) that a signal sent from outside could
  only hit by luck. The stops: `train.after_step`, `data.next_batch` (the loop is fetching the
  first batch of step N, phase data), `checkpoint.*` (checkpoint/store.py), `grpo.rollout` (step
  N's completions are sampled, not yet scored), `grpo.update` and `dpo.update` (step N's first
  micro-batch has been trained, the others not: train/grpo.py, train/dpo.py). With
  `TRAINBOOK_FAULT_REACHED=<file>` a stop first creates that file: a test times what follows the
  fault from that moment.
- Damage, `fault_active(point, step)`: the product asks whether to do the point's harm now. Those
  points and what they do (train/fault_hooks.py attaches them when armed):
  `model.block_nan`     block `TRAINBOOK_FAULT_BLOCK` (default 0) outputs NaN in the training
                        forward of the step (the loss and every gradient become NaN);
  `model.block_nan_once` the same in the step's first training forward only (a transient fault:
                        a re-run of the step is clean);
  `data.nan_batch`      the same while training on batch K of the data order (`@K`; step K's in a
                        run that skipped no data): bad data, met again by a replay of it;
  `data.slow_batch`     the step's first batch arrives late: the step takes TRAINBOOK_FAULT_SLOWDOWN
                        (default 10) times as long as the recent clean ones, on any machine;
  `data.random_batch`   the step's batches hold uniformly random token ids (a loss and gradient
                        spike; from a step on, `@N+`, training on noise: validation regresses);
  `data.skew_mix`       the step's rows from any source but the recipe's first are replaced by rows
                        of the first source (the mixture trained on drifts from its weights);
  `train.leak`          each step keeps a new `TRAINBOOK_FAULT_BYTES` (default 16 MiB) allocation
                        alive on the training device (a memory leak, grown in the data phase);
  `model.block_leak`    the same, kept by block `TRAINBOOK_FAULT_BLOCK` (default 0) in its training
                        forward once per step (a leak grown in the forward phase);
  `model.block_oom`     block `TRAINBOOK_FAULT_BLOCK` asks the allocator for `TRAINBOOK_FAULT_OOM_BYTES`
                        (default 2**50) in the training forward of the step: the allocator's real
                        out-of-memory failure (CPU: "DefaultCPUAllocator: can't allocate memory";
                        CUDA: torch.OutOfMemoryError) raised inside the block;
  `model.router_collapse` every MoE router of a training forward sees one vector along its expert
                        0's gate row in place of its tokens: all tokens go to the same k experts,
                        the others get none (`@N+`: a router collapsed from step N on);
  `comm.slow_sync`      the step's loss report (its last exposed collective) joins late on this
                        rank, by TRAINBOOK_FAULT_SLOWDOWN - 1 (default 9) times the recent clean
                        steps: a slow link, which every rank waits for in `grad_sync`;
  `comm.no_error_feedback` PowerSGD (parallel.grad_compression) forgets what compression lost
                        instead of adding it to the next gradient (arm it bare: the run's hook is
                        built once; parallel/compression.py): a broken remedy;
  `comm.skip_reduce`    DDP's hook hands every gradient bucket back unreduced: each rank steps on
                        its own gradient (arm it bare): a broken remedy;
  `comm.skip_outer`     delayed synchronisation (parallel.sync_every) skips its outer step: the
                        replicas train apart and never meet again (arm it bare): a broken remedy;
  `comm.slow_link`      DDP's gradient all-reduces complete late by their bytes over a link of
                        TRAINBOOK_FAULT_LINK_MBPS (default 20) MB/s, on the backend's thread (the
                        ranks compute on while it transfers, as beside a slow network; arm it bare):
                        communication-bound, and fewer bytes make it faster;
  `host.contend`        from its first step, `TRAINBOOK_FAULT_HOGS` (default 3 per usable CPU)
                        processes spin on the CPUs until the training process ends (contention).
  `check.slow_matmul`   `trainbook check`'s matmul probe on this rank (arm it bare or `@0`; pick
                        the rank with TRAINBOOK_FAULT_RANK) does every matmul TRAINBOOK_FAULT_SLOWDOWN
                        (default 10) times: a really slower rank, for the outlier rule to name.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "TRAINBOOK_FAULT"


def _steps_armed(point: str) -> list[tuple[int | None, bool]] | None:
    """(step or None for any, and-later) for each arming of `point` on this rank; None if unarmed."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    rank = os.environ.get("TRAINBOOK_FAULT_RANK")
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return None
    here = {"r": os.environ.get("RANK", "0"), "a": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}
    found = []
    for item in spec.split(","):
        armed, *qualifiers = item.strip().split(":")
        name, _, at = armed.partition("@")
        if name == point and all(here.get(q[:1]) == q[1:] for q in qualifiers):
            found.append((int(at.rstrip("+")) if at else None, at.endswith("+")))
    return found or None


def fault_armed(point: str) -> bool:
    """Whether `point` is armed at any step on this rank (to attach a hook only when needed)."""
    return _steps_armed(point) is not None


def fault_active(point: str, step: int) -> bool:
    """Whether `point` is armed for `step` on this rank."""
    for at, later in _steps_armed(point) or ():
        if at is None or at == step or (later and step >= at):
            return True
    return False


def fault_point(point: str, step: int) -> None:
    """Kill the process here (or hang, or wait for the release file) when armed for `step`."""
    if not fault_active(point, step):
        return
    action = os.environ.get("TRAINBOOK_FAULT_ACTION")
    reached = os.environ.get("TRAINBOOK_FAULT_REACHED")
    if reached:  # the moment of the fault, for a test that times what follows
        open(reached, "a").close()
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped whole: not even a thread of it runs
        return
    if action == "raise":
        raise RuntimeError(f"fault injected at {point} (step {step})")
    if action == "wait":
        _wait_for(os.environ["TRAINBOOK_FAULT_RELEASE"])
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(release: str) -> None:
    """Block until `release` exists, or until a SIGTERM arrives: the signal then takes its usual
    course (the loop's stop after the step), as it would for a rank busy computing."""
    termed = []
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        termed.append(signum)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_term)
    try:
        while not os.path.exists(release) and not termed:
            time.sleep(0.05)
    finally:
        if signal.getsignal(signal.SIGTERM) is on_term:
            signal.signal(signal.SIGTERM, previous)
