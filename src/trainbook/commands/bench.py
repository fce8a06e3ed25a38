"""`trainbook bench data`: the data path alone, against what training consumes; `trainbook bench
comm`: collective bus bandwidth on local ranks (the workers: `parallel/comm_bench.py`)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainbook.commands.preflight import prepare_data
from trainbook.commands.recipe import recipe_and_overrides
from trainbook.commands.resolve import resolve
from trainbook.config import Config
from trainbook.data import Prepared, TrainLoader
from trainbook.errors import TrainbookError
from trainbook.parallel import pick_device
from trainbook.parallel.comm_bench import KiB, MiB, message_sizes, render
from trainbook.runs import RunPaths
from trainbook.sizes import parse_size
from trainbook.train.build import one_process


@dataclass
class DataBench:
    samples_per_s: float
    tokens_per_s: float
    train_tokens_per_s: float
    train_source: str
    """Where the training figure came from: a run's metrics.jsonl, or a short probe."""

    @property
    def headroom(self) -> float:
        return self.tokens_per_s / self.train_tokens_per_s

    def verdict(self) -> str:
        if self.headroom >= 10:
            return f"data loading will not hold training back ({self.headroom:,.0f}x what it consumes)"
        if self.headroom >= 1.5:
            return (f"data loading keeps up, with little margin ({self.headroom:.1f}x); "
                    "raise data.num_workers to be safe")
        return (f"data loading WILL hold training back: it delivers {self.headroom:.2f}x what training "
                "consumes; raise data.num_workers")


def loader_rate(cfg: Config, data: Prepared, seconds: float) -> tuple[float, float]:
    """(samples/s, tokens/s) of the training loader alone, after a warm-up batch."""
    t = cfg.train
    loader = TrainLoader(
        data.train, {s.name: s.weight for s in cfg.data.sources}, t.seq_len, t.micro_batch_size,
        cfg.run.seed, packing=cfg.data.packing, eos_id=data.tokenizer.eos_id,
        num_workers=cfg.data.num_workers, pin_memory=bool(cfg.data.pin_memory),
    )
    try:
        batches = iter(loader)
        next(batches)  # warm-up: workers start, pages load
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            next(batches)
            n += 1
        elapsed = time.perf_counter() - start
    finally:
        loader.close()
    samples = n * t.micro_batch_size
    return samples / elapsed, samples * t.seq_len / elapsed


def training_rate(cfg: Config, data: Prepared, device: torch.device, probe_steps: int = 4) -> tuple[float, str]:
    """Tokens/s that training consumes: the newest run's metrics, else a short probe."""
    folders = sorted(Path(cfg.run.runs_root, cfg.run.name).glob("*"))
    runs = [m for m in (RunPaths.of(d).metrics for d in folders) if m.is_file()]
    for metrics in reversed(runs):
        rates = [r["tokens_per_s"] for r in map(json.loads, metrics.read_text().splitlines())
                 if r.get("kind") == "train"]
        if rates:
            return statistics.median(rates), str(metrics)
    # The probe trains for real: a few steps.
    probe = cfg.model_copy(update={
        "log": cfg.log.model_copy(update={"progress": "plain", "every_steps": 10**9}),
        "train": cfg.train.model_copy(update={"eval_every": 0}),
    })
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = one_process(probe, Path(run_dir), data, device)
        trainer.advance()  # warm-up
        rates = [trainer.advance().tokens_per_s for _ in range(probe_steps)]
        trainer.close()
    return statistics.median(rates), f"a {probe_steps}-step training probe"


def bench_data_command(recipe: str | None, overrides: list[str] | None, seconds: float, log=print) -> str:
    """What `trainbook bench data` prints."""
    path, overrides = recipe_and_overrides(recipe, overrides)
    res = resolve(path, overrides, world_size=1, local_ranks=1)
    cfg = res.cfg
    result = bench_data(cfg, prepare_data(res, log=log), pick_device(cfg.run.device), seconds)
    return (f"loader: {result.samples_per_s:,.0f} samples/s, {result.tokens_per_s:,.0f} tokens/s "
            f"(data.num_workers={cfg.data.num_workers})\n"
            f"training consumes {result.train_tokens_per_s:,.0f} tokens/s (from {result.train_source})\n"
            + result.verdict())


def bench_data(cfg: Config, data: Prepared, device: torch.device, seconds: float = 5.0) -> DataBench:
    samples_per_s, tokens_per_s = loader_rate(cfg, data, seconds)
    train_tps, source = training_rate(cfg, data, device)
    return DataBench(samples_per_s, tokens_per_s, train_tps, source)


def bench_comm_command(
    nproc: int,
    max_bytes: int | str = 64 * MiB,
    iters: int = 20,
    *,
    min_bytes: int = KiB,
    warmup: int = 5,
    dtype: str = "float32",
    device: str = "auto",
    timeout_s: float = 600,
    grad_compression: bool = False,
) -> str:
    """Run the bench on `nproc` local ranks through torch.distributed.run; the text to print.
    `max_bytes`: bytes, or a size as written on the command line ("64MiB"). `grad_compression`:
    DDP's gradient reduction under each `parallel.grad_compression` instead of the collectives.

    TrainbookError for bad arguments (before any process starts); RuntimeError, with the
    workers' log tail, if the ranks fail or write no result.
    """
    if isinstance(max_bytes, str):
        max_bytes = parse_size(max_bytes, where="--max-bytes")
    if nproc < 1:
        raise TrainbookError(f"must be at least 1, got {nproc}", where="--nproc")
    if iters < 1 or warmup < 0:
        raise TrainbookError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}",
                             where="--iters")
    try:
        message_sizes(min_bytes, max_bytes)
    except ValueError as e:
        raise TrainbookError(str(e), where="--max-bytes") from None
    with tempfile.TemporaryDirectory(prefix="trainbook-comm-") as tmp:
        out = Path(tmp) / "comm.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "trainbook.parallel.comm_bench",
               "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes),
               "--iters", str(iters), "--warmup", str(warmup), "--dtype", dtype,
               "--device", device, "--json", str(out), *(["--grad-compression"] if grad_compression else [])]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its workers (SIGKILL 30 s later)
            log, _ = proc.communicate()
            raise RuntimeError(f"comm bench timed out after {timeout_s} s:\n{log[-3000:]}") from None
        if not out.exists() or proc.returncode != 0:
            raise RuntimeError(f"comm bench failed (exit code {proc.returncode}):\n{log[-3000:]}")
        result = json.loads(out.read_text())
    return render(result)
