"""The Trainer (build + loop), the train step, optimizer and LR schedule."""

from trainbook.train.run import prepare_data, resolve_config, start_run
from trainbook.train.trainer import Trainer

__all__ = ["Trainer", "prepare_data", "resolve_config", "start_run"]
