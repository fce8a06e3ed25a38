"""Learning-rate schedules: linear warmup, then cosine, linear or constant.

The schedule is a pure function of the step, so it needs no state of its own in a checkpoint:
the trainer's step counter is enough.
"""

from __future__ import annotations

import math

from trainbook.config import ScheduleConfig


class LRSchedule:
    def __init__(self, cfg: ScheduleConfig, peak_lr: float, max_steps: int):
        self.kind = cfg.kind
        self.warmup = cfg.warmup_steps
        self.peak = peak_lr
        self.floor = peak_lr * cfg.min_lr_ratio
        self.max_steps = max_steps

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup:
            return self.peak * (step + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return self.peak
        decay_steps = max(1, self.max_steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / decay_steps)
        if self.kind == "cosine":
            return self.floor + (self.peak - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.peak - (self.peak - self.floor) * progress
