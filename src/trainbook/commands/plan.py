"""`trainbook plan`: the recipe resolved exactly as `trainbook run` resolves it, then laid out."""

from __future__ import annotations

import json
from pathlib import Path

from trainbook.commands.resolve import resolve
from trainbook.config import load_config
from trainbook.errors import TrainbookError
from trainbook.parallel.plan import make_plan
from trainbook.parallel.plan_text import render
from trainbook.sizes import parse_size


def plan_command(recipe: Path, overrides: list[str], world_size: int | None, device_memory: str | None,
                 as_json: bool) -> str:
    """What `trainbook plan` prints: the plan of `recipe` (+ overrides) on `world_size` ranks
    (None: the world of the recipe's `[launch]`)."""
    limit = parse_size(device_memory, where="--device-memory") if device_memory is not None else None
    if world_size is None:
        world_size = load_config(Path(recipe), overrides).launch.world_size
    if world_size < 1:
        raise TrainbookError(f"must be at least 1, got {world_size}", where="--world-size")
    res = resolve(Path(recipe), overrides, world_size, device_memory=limit)
    plan = make_plan(res.plan_inputs(), res.dims, limit, recipe=str(recipe))
    return json.dumps(plan, indent=2) if as_json else render(plan)
