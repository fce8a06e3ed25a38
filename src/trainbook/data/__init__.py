"""The data path: sources -> documents -> tokenizer -> token shards -> packed batches.

`prepare(cfg.data, cfg.tokenizer, seed=cfg.run.seed)` makes (or finds cached) the tokenized
train/val streams; `TrainLoader` and `val_batches` cut them into (inputs, targets) batches.
"""

from trainbook.data.loader import TrainLoader, val_batches
from trainbook.data.prepare import Prepared, prepare
from trainbook.data.tokenizer import Tokenizer

__all__ = ["Prepared", "Tokenizer", "TrainLoader", "prepare", "val_batches"]
