"""DCP checkpoints: atomic commit with a verified manifest, retention, async save, resume, export."""

from trainbook.checkpoint.store import (
    Checkpointer, InvalidCheckpoint, any_rank, flatten, latest_checkpoint, load_state, locate, newest_valid,
    read_latest, step_of, tensor_entries, verify,
)

__all__ = [
    "Checkpointer", "InvalidCheckpoint", "any_rank", "flatten", "latest_checkpoint", "load_state", "locate",
    "newest_valid", "read_latest", "step_of", "tensor_entries", "verify",
]
