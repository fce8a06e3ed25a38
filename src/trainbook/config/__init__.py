"""Recipe schema, loading (`extends`, overrides), validation and the resolved dump."""

from trainbook.config.checkpoint import CheckpointConfig
from trainbook.config.data import DataConfig, SourceConfig, TokenizerConfig
from trainbook.config.diagnose import DiagnoseConfig, TriageConfig
from trainbook.config.load import dotted_keys, dump_toml, load_config, parse_override, with_defaults
from trainbook.config.lora import LoraConfig
from trainbook.config.model import ModelConfig
from trainbook.config.monitor import ALERT_RULES, AlertsConfig, LogConfig, MonitorConfig
from trainbook.config.parallel import ParallelConfig
from trainbook.config.run import RunConfig
from trainbook.config.schema import Config
from trainbook.config.secrets import redact_tree, scrub, secret_values
from trainbook.config.train import OptimConfig, PrecisionConfig, ScheduleConfig, TrainConfig

__all__ = [
    "ALERT_RULES", "AlertsConfig", "MonitorConfig", "CheckpointConfig", "Config", "DataConfig", "DiagnoseConfig", "LogConfig", "LoraConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "PrecisionConfig", "RunConfig", "ScheduleConfig", "SourceConfig",
    "TokenizerConfig", "TrainConfig", "TriageConfig", "dotted_keys", "dump_toml", "load_config", "parse_override", "with_defaults",
    "redact_tree", "scrub", "secret_values",
]
