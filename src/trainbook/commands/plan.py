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
    if as_json:
        return json.dumps(plan | {"expect": [e.model_dump() for e in res.cfg.expect]}, indent=2)
    return render(plan) + "".join(f"\n{line}" for line in expected_lines(res.cfg.expect))


def expected_lines(figures: list) -> list[str]:
    """The recipe's published figures (`[[expect]]`), each with where it comes from."""
    if not figures:
        return []
    lines = ["", "Published figures this recipe should reach ([[expect]])"]
    for f in figures:
        value = f"{f.value:.1%}" if f.metric == "mfu" else f"{f.value:,g}"
        lines.append(f"  {f.metric} {value} on {f.hardware}" + (f" ({f.setting})" if f.setting else ""))
        lines.append(f"    source: {f.source}")
    return lines
