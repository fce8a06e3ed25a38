"""`[checkpoint]`: when the run saves its state and which saves it keeps."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainbook.config.section import Section


class CheckpointConfig(Section):
    interval_steps: int = Field(default=0, ge=0)
    """Save every N steps; 0 saves only at the end of training (and on SIGTERM/SIGINT)."""
    interval_minutes: float = Field(default=0.0, ge=0)
    """Also save when this many minutes have passed since the last save; 0 turns it off."""
    mode: Literal["sync", "async"] = "sync"
    """`async`: training continues while the state is written (one save in flight at most)."""
    keep_last: int = Field(default=3, ge=1)
    """Keep the newest N checkpoints; older ones are deleted in the background after a save."""
    keep_every: int = Field(default=0, ge=0)
    """Also keep every checkpoint whose step is a multiple of N (milestones); 0 keeps none extra."""
