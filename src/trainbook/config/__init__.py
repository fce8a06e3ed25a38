"""Recipe schema, loading (`extends`, overrides), validation and the resolved dump."""

from trainbook.config.load import dotted_keys, dump_toml, load_config, parse_override
from trainbook.config.secrets import redact_tree, scrub, secret_values
from trainbook.config.schema import (
    ALERT_RULES,
    AlertsConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DiagnoseConfig,
    LogConfig,
    MonitorConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    ScheduleConfig,
    SourceConfig,
    TokenizerConfig,
    TrainConfig,
    TriageConfig,
)

__all__ = [
    "ALERT_RULES", "AlertsConfig", "MonitorConfig", "CheckpointConfig", "Config", "DataConfig", "DiagnoseConfig", "LogConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "PrecisionConfig", "RunConfig", "ScheduleConfig", "SourceConfig",
    "TokenizerConfig", "TrainConfig", "TriageConfig", "dotted_keys", "dump_toml", "load_config", "parse_override",
    "redact_tree", "scrub", "secret_values",
]
