"""Checkpoint save and load speed for a ~1.2 GB training state, against raw writes to the same disk.

The state is what the trainer saves: a Llama's `state_dict()` plus two AdamW moments and a step
per parameter, trainer counters and the data position (fp32: parameters x 4 bytes x 3). All
files go to one directory on one disk, and both sides of each comparison start with the
previous round's files deleted, so neither inherits the other's page cache. The disk matters
too: on this VM (ext4 mounted with `discard`, thin-provisioned) a write into blocks freed more
than a few seconds earlier runs ~5x slower than one into blocks just freed. By default every
timed write follows the deletion of ~1.2 GB at once (the fast case, where software overhead
shows most); `--settle 10` waits after each deletion (the slow case: a disk that dominates).

1. Sync save: `Checkpointer(mode="sync").save()` (DCP write + fsync, CRC-32 of every file,
   manifest, rename, `latest`) against writing the same tensors' bytes to one file with
   `open().write()` + `os.fsync` from the buffers already in memory. Interleaved rounds (raw,
   sync, sync, raw, ...: each round swaps the order), medians. Ratio = raw time / sync time.
   The sync save's time is split into DCP's write (serialization on two writer threads, the
   CRC-32 taken as the bytes pass, the copy into the page cache) and fsync. Goal >= 0.5.
2. Async save: the time the training loop is blocked, as a fraction of the median sync save.
   `save()` returns at once and copies the state aside in a thread while the next step's forward
   and backward run (here: the benchmark model on `--step-tokens` tokens); the loop waits in
   `wait_staged()` before its optimizer step. Blocked = time inside save() + wait_staged().
   Reported apart: how much longer that forward+backward took than the same compute alone just
   before (the copy and the background write compete for the CPU cores; on an accelerator the
   step's compute is not on them). Staging buffers are allocated by the first save and reused
   after, so the first save is reported apart from the steady state. Goal <= 0.1.
3. Load: `verify()` (reads and CRC-checks every file) then `load_state()` into preallocated
   tensors, with the checkpoint's pages dropped from the page cache first (posix_fadvise: the
   files were just written, so a load would otherwise read memory, not disk). No goal.

    .venv/bin/python benchmarks/checkpoint.py [--gb 1.2] [--rounds 3] [--async-saves 3] [--settle 0] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainbook.checkpoint import Checkpointer, flatten, load_state, verify
from trainbook.config import CheckpointConfig, ModelConfig
from trainbook.model import build_model, num_params, resolve

GB = 1e9

# Llama-shaped blocks of ~11.3M parameters each; the number of blocks sets the size.
SHAPE = dict(dim=1024, n_heads=8, n_kv_heads=2, ffn_dim=2816, vocab_size=8192)


def build_state(gb: float) -> tuple[dict, torch.nn.Module]:
    """A trainer-like state of about `gb` GB: model, AdamW moments, counters, data position."""
    def params(n_layers: int) -> int:
        cfg = resolve(ModelConfig(name="tiny", n_layers=n_layers, **SHAPE))
        return num_params(build_model(cfg, "meta", seed=0))

    # parameters x 4 bytes x 3 (weights, exp_avg, exp_avg_sq) = gb; size is linear in n_layers.
    per_layer = params(2) - params(1)
    n_layers = max(1, round((gb * GB / 12 - (params(1) - per_layer)) / per_layer))
    model = build_model(resolve(ModelConfig(name="tiny", n_layers=n_layers, **SHAPE)), "cpu", seed=0)
    # Random moments rather than zeros: every page is real memory, as after a few training steps.
    optim = {
        name: {"exp_avg": torch.randn_like(p) * 1e-3, "exp_avg_sq": torch.rand_like(p) * 1e-6,
               "step": torch.tensor(100.0)}
        for name, p in model.named_parameters()
    }
    return {
        "model": model.state_dict(),  # as the trainer's: the tied output head is a key of its own
        "optim": optim,
        "trainer": {"step": torch.tensor(100), "tokens": torch.tensor(100 * 65536)},
        "data": {"consumed": torch.tensor(6400)},
    }, model


def forward_backward(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    """A training step's compute between two optimizer updates (what async staging overlaps)."""
    model(tokens).float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)


def raw_write(path: Path, tensors: list[torch.Tensor]) -> None:
    """The floor: the tensors' bytes, straight from their buffers, to one file, then fsync."""
    with open(path, "wb") as f:
        for t in tensors:
            f.write(t.reshape(-1).view(torch.uint8).numpy())  # no copy: numpy shares the buffer
        f.flush()
        os.fsync(f.fileno())


def drop_cached_pages(path: Path) -> None:
    """Ask the kernel to drop the (clean, fsynced) pages of every file under `path`; no root needed."""
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Phases:
    """Wall time spent inside os.fsync while active (the rest is DCP's write with its CRC-32 taken
    on the way, planning and the commit's small files). The overhead is a call each."""

    def __init__(self):
        self.fsync = 0.0
        self._fsync = os.fsync

    def _timed(self, fn, attr):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - start)
        return wrapper

    def __enter__(self):
        self.fsync = 0.0
        os.fsync = self._timed(self._fsync, "fsync")
        return self

    def __exit__(self, *exc):
        os.fsync = self._fsync


def like(state: dict) -> dict:
    """Zeroed tensors shaped like `state` (touched, like a live model's parameters)."""
    return {k: like(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.2, help="target state size in GB (1e9 bytes)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved raw/sync rounds, and load rounds")
    parser.add_argument("--async-saves", type=int, default=6, help="async saves (the first warms the buffers)")
    parser.add_argument("--step-tokens", type=int, default=128,
                        help="tokens in the forward+backward that async staging overlaps")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds to wait after deleting files before each timed write (see above)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="trainbook-ckpt-bench-", dir=args.dir))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    started = time.perf_counter()
    state, model = build_state(args.gb)
    tensors = list(flatten(state).values())
    nbytes = sum(t.nbytes for t in tensors)
    n_params = sum(t.numel() for t in state["model"].values())
    print(f"state: {nbytes / GB:.3f} GB in {len(tensors)} tensors (model {n_params:,} values, "
          f"+ 2 AdamW moments each), built in {time.perf_counter() - started:.1f} s")
    print(f"directory: {work}, torch threads {torch.get_num_threads()}", flush=True)

    sync_cfg = CheckpointConfig(mode="sync", keep_last=1)

    # Warm-up: DCP's first call pays imports and set-up that a training run pays once, and the
    # first full-size write is the one that finds the disk's blocks long freed (see above).
    ckpt = Checkpointer(work / "warmup", sync_cfg)
    ckpt.save(0, {"model": {"w": torch.randn(1 << 20)}})
    ckpt.close()
    shutil.rmtree(work / "warmup")
    raw_write(work / "warmup.bin", tensors)
    (work / "warmup.bin").unlink()

    def settle() -> None:
        if args.settle:
            os.sync()
            time.sleep(args.settle)

    # ---- 1. sync save against raw writes, interleaved --------------------------------------
    raw_times, sync_times, ratios, phases, on_disk = [], [], [], Phases(), 0

    def time_raw() -> None:
        settle()
        start = time.perf_counter()
        raw_write(work / "raw.bin", tensors)
        raw_times.append(time.perf_counter() - start)
        (work / "raw.bin").unlink()

    def time_sync(i: int) -> None:
        nonlocal on_disk
        # A fresh root per round: the previous round's checkpoint is deleted here, not by
        # keep_last's background thread while the next side is being timed.
        ckpt = Checkpointer(work / f"sync-{i}", sync_cfg)
        settle()
        with phases:
            start = time.perf_counter()
            path = ckpt.save(100 + i, state)
            sync_times.append(time.perf_counter() - start)
        ckpt.close()
        on_disk = sum(p.stat().st_size for p in path.iterdir())
        shutil.rmtree(work / f"sync-{i}")

    for i in range(args.rounds):
        if i % 2 == 0:
            time_raw(), time_sync(i)
        else:
            time_sync(i), time_raw()
        ratios.append(raw_times[-1] / sync_times[-1])
        rest = sync_times[-1] - phases.fsync
        print(f"round {i + 1}: raw {raw_times[-1]:.2f} s ({nbytes / raw_times[-1] / GB:.2f} GB/s)  "
              f"sync save {sync_times[-1]:.2f} s ({nbytes / sync_times[-1] / GB:.2f} GB/s)  "
              f"ratio {ratios[-1]:.3f}  [sync: dcp write + crc32 {rest:.2f} s, fsync {phases.fsync:.2f} s]",
              flush=True)
    sync_median = statistics.median(sync_times)

    # ---- 2. async save: time the training loop is blocked -----------------------------------
    # The trainer saves after an optimizer step, runs the next step's forward and backward, and
    # calls wait_staged() just before its optimizer step: staging overlaps that compute. Blocked
    # time = inside save() and wait_staged(); the compute's slowdown is reported apart.
    ckpt = Checkpointer(work / "async", CheckpointConfig(mode="async", keep_last=1))
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, args.step_tokens))
    forward_backward(model, tokens)  # warm-up
    blocked, slowdowns, computes, committed = [], [], [], []
    for i in range(args.async_saves):
        settle()
        start = time.perf_counter()
        forward_backward(model, tokens)
        computes.append(time.perf_counter() - start)
        # The trainer builds its state dict at each save; same storages, so staging reuses buffers.
        step_state = {**state, "model": state["model"].copy()}
        start = time.perf_counter()
        path = ckpt.save(200 + i, step_state)
        in_save = time.perf_counter() - start
        forward_backward(model, tokens)
        waited = time.perf_counter()
        ckpt.wait_staged()
        in_wait = time.perf_counter() - waited
        call = in_save + in_wait
        slowdowns.append(time.perf_counter() - start - call - computes[-1])
        blocked.append(call)
        ckpt.wait()
        committed.append(time.perf_counter() - start)
        print(f"async save {i + 1}{' (first: allocates staging buffers)' if i == 0 else ''}: "
              f"blocked {blocked[-1]:.3f} s = save() {in_save:.3f} + wait_staged() {in_wait:.3f} "
              f"({blocked[-1] / sync_median:.3f} of a sync save), committed "
              f"after {committed[-1]:.2f} s; step compute {computes[-1]:.2f} s alone, "
              f"{computes[-1] + slowdowns[-1]:.2f} s beside the save", flush=True)
        if i < args.async_saves - 1:
            shutil.rmtree(path)  # so keep_last has nothing to delete in the background
    ckpt.close()

    def steady(xs: list[float]) -> float:
        return statistics.median(xs[1:] or xs)

    # ---- 3. load: verify + load_state from disk ---------------------------------------------
    target = like(state)
    verify_times, load_times = [], []
    for i in range(args.rounds):
        drop_cached_pages(path)
        start = time.perf_counter()
        verify(path)
        verify_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_state(path, target)
        load_times.append(time.perf_counter() - start)
        total = verify_times[-1] + load_times[-1]
        print(f"load {i + 1}: verify {verify_times[-1]:.2f} s + load_state {load_times[-1]:.2f} s = "
              f"{total:.2f} s ({nbytes / total / GB:.2f} GB/s)", flush=True)
    same = all(torch.equal(a, b) for a, b in zip(tensors, flatten(target).values(), strict=True))

    # ---- summary ------------------------------------------------------------------------------
    raw_m, ratio = statistics.median(raw_times), statistics.median(ratios)
    v_m, l_m = statistics.median(verify_times), statistics.median(load_times)
    print(f"\nstate {nbytes / GB:.3f} GB ({on_disk / GB:.3f} GB as a DCP checkpoint), "
          f"{args.rounds} rounds, settle {args.settle:g} s, medians; total {time.perf_counter() - started:.0f} s")
    print(f"sync save: {sync_median:.2f} s = {nbytes / sync_median / GB:.2f} GB/s; raw write + fsync "
          f"{raw_m:.2f} s = {nbytes / raw_m / GB:.2f} GB/s")
    print(f"  ratio (raw time / sync time): median of rounds {ratio:.3f}, "
          f"all rounds {sum(raw_times) / sum(sync_times):.3f}  "
          f"(goal >= 0.5: {'met' if ratio >= 0.5 else 'MISSED'})")
    blocked_ratio = steady(blocked) / sync_median
    print(f"async save: blocked {steady(blocked):.3f} s in the steady state (first save {blocked[0]:.3f} s), "
          f"committed after {steady(committed):.2f} s")
    print(f"  blocked / sync save: {blocked_ratio:.3f} steady, {blocked[0] / sync_median:.3f} first  "
          f"(goal <= 0.1: {'met' if blocked_ratio <= 0.1 else 'MISSED'})")
    print(f"  the overlapped forward+backward: {steady(computes):.2f} s alone, "
          f"{steady(computes) + steady(slowdowns):.2f} s beside the background copy and write (CPU cores shared)")
    print(f"load (page cache dropped): {v_m + l_m:.2f} s = {nbytes / (v_m + l_m) / GB:.2f} GB/s "
          f"(verify {v_m:.2f} s = {v_m / (v_m + l_m):.0%}, load_state {l_m:.2f} s); "
          f"loaded state bitwise equal to the saved one: {same}")


if __name__ == "__main__":
    main()
