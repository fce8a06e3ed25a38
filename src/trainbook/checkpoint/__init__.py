"""DCP checkpoints: save, latest pointer, retention, load."""

from trainbook.checkpoint.store import Checkpointer, latest_checkpoint, load_state, locate

__all__ = ["Checkpointer", "latest_checkpoint", "load_state", "locate"]
