"""`[run]`: the run's name, its one seed, and where it runs (device, CPU threads, the archive root)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainbook.config.section import Section


class RunConfig(Section):
    name: str | None = None
    """Run name; runs are archived under `<runs_root>/<name>/`. Defaults to the recipe's file stem."""
    seed: int = 0
    """The one seed: model init, data order, dropout and sampling all derive from it."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where to train: `auto` picks cuda, then npu, then cpu."""
    runs_root: str = "runs"
    """Directory that holds the run archive, relative to the working directory."""
    threads: int | None = Field(default=None, ge=1)
    """CPU threads for intra-op parallelism (torch.set_num_threads); unset keeps torch's default."""
