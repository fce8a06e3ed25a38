"""The Trainer (build + one loop), the step engines and the train step, optimizer, LR schedule, RNG."""

from trainbook.train.trainer import Trainer

__all__ = ["Trainer"]
