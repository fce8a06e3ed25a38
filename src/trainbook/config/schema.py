"""The recipe schema: one typed, frozen tree, one section per component.

Every field has a default and a docstring under it, which is its documentation (pydantic keeps
it as the field's description). Unknown keys are errors. Components receive their own section only, e.g. ``build_model(cfg.model)``.

The sections live beside this file, one module per part of the run (the tables each holds):
`run`, `data` (`data`, `tokenizer`), `model`, `moe`, `lora`, `grpo`, `dpo`, `train` (`optim`, `schedule`, `train`,
`precision`), `parallel`, `checkpoint`, `monitor` (`log`, `monitor`, `alerts`), `diagnose`
(`diagnose`, `triage`) and `book` (`env`, `launch`, `expect`); `section.py` holds their base.
"""

from __future__ import annotations

import math

from trainbook.config.book import EnvConfig, ExpectedFigure, LaunchConfig
from trainbook.config.checkpoint import CheckpointConfig
from trainbook.config.data import DataConfig, TokenizerConfig
from trainbook.config.diagnose import DiagnoseConfig, TriageConfig
from trainbook.config.dpo import DpoConfig
from trainbook.config.grpo import GrpoConfig
from trainbook.config.lora import LoraConfig
from trainbook.config.model import ModelConfig
from trainbook.config.moe import MoeConfig
from trainbook.config.monitor import AlertsConfig, LogConfig, MonitorConfig
from trainbook.config.parallel import ParallelConfig
from trainbook.config.run import RunConfig
from trainbook.config.section import Section
from trainbook.config.train import OptimConfig, PrecisionConfig, ScheduleConfig, TrainConfig


class Config(Section):
    """A whole recipe. `extends` is consumed while loading and never appears here."""

    run: RunConfig = RunConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    moe: MoeConfig = MoeConfig()
    lora: LoraConfig = LoraConfig()
    grpo: GrpoConfig = GrpoConfig()
    dpo: DpoConfig = DpoConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig()
    precision: PrecisionConfig = PrecisionConfig()
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    monitor: MonitorConfig = MonitorConfig()
    alerts: AlertsConfig = AlertsConfig()
    env: EnvConfig = EnvConfig()
    launch: LaunchConfig = LaunchConfig()
    expect: list[ExpectedFigure] = []
    """Published figures this recipe should reach (`[[expect]]` tables), each with its source."""
    diagnose: DiagnoseConfig = DiagnoseConfig()
    triage: TriageConfig = TriageConfig()

    @property
    def dpo_enabled(self) -> bool:
        """DPO trains when the sources are preference pairs (resolution checks they all are)."""
        return any(s.format == "preference" for s in self.data.sources)

    @property
    def rows_per_sample(self) -> int:
        """Sequences a sample of `train.micro_batch_size` is: a DPO pair is two."""
        return 2 if self.dpo_enabled else 1

    def accum_steps(self, dp: int) -> int:
        """Micro-batches per optimizer step on each of `dp` data-parallel ranks: a GRPO step's
        share of its rollout's completions, a DPO step's share of its pairs, or the token
        budget's (of a resolved config: `train.micro_batch_size` is a number)."""
        t = self.train
        if self.grpo.enabled or self.dpo_enabled:  # this rank's completions or pairs, a micro-batch at a time
            items = self.grpo.completions if self.grpo.enabled else self.dpo.pairs_per_step
            return math.ceil(items // dp / t.micro_batch_size)
        return t.grad_accum_steps(dp)
