"""The data path: sources -> documents -> tokenizer -> token shards -> packed batches.

`prepare(cfg.data, cfg.tokenizer, seed=cfg.run.seed)` makes (or finds cached) the tokenized
train/val streams; `TrainLoader` and `val_batches` cut them into (inputs, targets) batches.
"""

from trainbook.data.loader import TrainLoader, val_batches
from trainbook.data.samples import check_train_split, check_val_split, padding_report
from trainbook.data.prepare import Prepared, find_prepared, prepare
from trainbook.data.tokenizer import Tokenizer, hf_tokenizer_config

__all__ = [
    "Prepared", "Tokenizer", "TrainLoader", "check_train_split", "check_val_split", "find_prepared", "hf_tokenizer_config",
    "padding_report", "prepare", "val_batches",
]
