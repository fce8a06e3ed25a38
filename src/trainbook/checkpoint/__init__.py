"""DCP checkpoints: atomic commit with a verified manifest, retention, async save, resume, export."""

from trainbook.checkpoint.read import (
    flatten, latest_checkpoint, load_state, locate, newest_valid, read_latest, tensor_entries, verify,
)
from trainbook.checkpoint.store import Checkpointer, InvalidCheckpoint, any_rank, step_of

__all__ = [
    "Checkpointer", "InvalidCheckpoint", "any_rank", "flatten", "latest_checkpoint", "load_state", "locate",
    "newest_valid", "read_latest", "step_of", "tensor_entries", "verify",
]
