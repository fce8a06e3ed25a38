"""`trainbook bench data`: the data path alone, against what training consumes."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainbook.config import Config
from trainbook.data import Prepared, TrainLoader


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
    runs = sorted(Path(cfg.run.runs_root, cfg.run.name).glob("*/metrics.jsonl"))
    for metrics in reversed(runs):
        rates = [r["tokens_per_s"] for r in map(json.loads, metrics.read_text().splitlines())
                 if r.get("kind") == "train"]
        if rates:
            return statistics.median(rates), str(metrics)
    from trainbook.train.trainer import Trainer  # the probe trains for real: a few steps

    probe = cfg.model_copy(update={
        "log": cfg.log.model_copy(update={"progress": "plain", "every_steps": 10**9}),
        "train": cfg.train.model_copy(update={"eval_every": 0}),
    })
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(probe, Path(run_dir), data, device)
        batches = iter(trainer.train_loader)
        trainer.advance(batches)  # warm-up
        rates = [trainer.advance(batches).tokens_per_s for _ in range(probe_steps)]
        trainer.close()
    return statistics.median(rates), f"a {probe_steps}-step training probe"


def bench_data(cfg: Config, data: Prepared, device: torch.device, seconds: float = 5.0) -> DataBench:
    samples_per_s, tokens_per_s = loader_rate(cfg, data, seconds)
    train_tps, source = training_rate(cfg, data, device)
    return DataBench(samples_per_s, tokens_per_s, train_tps, source)
