"""Which recipe a command means, from its arguments."""

from __future__ import annotations

from pathlib import Path

from trainbook.errors import TrainbookError

DEFAULT_RECIPE = "recipes/tiny-shakespeare.toml"


def default_recipe() -> Path:
    """The embedded default: the working directory's copy if there is one, else the packaged one."""
    local = Path(DEFAULT_RECIPE)
    return local if local.is_file() else Path(__file__).parents[1] / "recipes" / local.name


def recipe_and_overrides(
    recipe: str | None, overrides: list[str] | None, fallback: Path | None = None
) -> tuple[Path, list[str]]:
    """`trainbook run train.max_steps=5` means the default recipe (or `fallback`) with one override."""
    overrides = list(overrides or [])
    if recipe is not None and "=" in recipe and not recipe.endswith(".toml"):
        overrides.insert(0, recipe)
        recipe = None
    if recipe is None:
        return fallback or default_recipe(), overrides
    path = Path(recipe)
    if not path.is_file():
        raise TrainbookError("recipe file not found", where=recipe)
    return path, overrides


def archived_config(run_dir: Path | None, resume: str) -> Path | None:
    """Continuing a run needs no recipe: the run (or the checkpoint's run) holds its resolved config."""
    if resume == "never":
        return None
    candidates = [run_dir] if run_dir is not None else []
    if resume != "auto":
        candidates += [Path(resume), Path(resume).parent.parent]
    for folder in candidates:
        if (folder / "config.resolved.toml").is_file():
            return folder / "config.resolved.toml"
    return None
