"""`trainbook prepare` (the data alone) and `trainbook config` (the resolved recipe as TOML)."""

from __future__ import annotations

from trainbook.commands.preflight import prepare_data
from trainbook.commands.recipe import recipe_and_overrides
from trainbook.commands.resolve import resolve
from trainbook.config import dump_toml


def prepare_command(recipe: str | None, overrides: list[str] | None, log=print) -> str:
    path, overrides = recipe_and_overrides(recipe, overrides)
    data = prepare_data(resolve(path, overrides, world_size=1), log=log)
    state = "cached" if data.cached else "prepared"
    splits = data.manifest["splits"]
    return (f"{state}: {data.dir} (train {splits['train']['tokens']:,} tokens, "
            f"val {splits['val']['tokens']:,} tokens)")


def config_command(recipe: str | None, overrides: list[str] | None) -> str:
    path, overrides = recipe_and_overrides(recipe, overrides)
    return dump_toml(resolve(path, overrides, world_size=1).cfg)
