"""Which recipe a command means, from its arguments."""

from __future__ import annotations

import subprocess
import sys
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
    from trainbook.runs import RunPaths  # imports torch: not at the CLI's start

    if resume == "never":
        return None
    candidates = [run_dir] if run_dir is not None else []
    if resume != "auto":
        candidates += [Path(resume), Path(resume).parent.parent]
    for folder in candidates:
        config = RunPaths.of(folder).config
        if config.is_file():
            return config
    return None


def baseline_path(recipe: Path, name: str) -> Path:
    """Where a recipe's baseline lives: `baselines/<name>.json` beside the recipe."""
    return Path(recipe).parent / "baselines" / f"{name}.json"


def run_argv(recipe: Path | str, overrides: list[str], run_dir: Path | str) -> list[str]:
    """The argv of `trainbook run RECIPE OVERRIDES --run-dir RUN_DIR` with this interpreter."""
    return [sys.executable, "-m", "trainbook", "run", str(recipe), *overrides, "--run-dir", str(run_dir)]


def run_in_subprocess(recipe: Path, overrides: list[str], run_dir: Path, output: Path | None = None) -> int:
    """`trainbook run RECIPE OVERRIDES --run-dir RUN_DIR` as a child process, exactly as a person
    types it; its output goes to the terminal, or to the file `output`. Returns its exit code."""
    cmd = run_argv(recipe, overrides, run_dir)
    if output is None:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "wb") as out:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT).returncode


def last_error(output: Path) -> str:
    """The one-line error a run printed (`trainbook: error: ...`), else its last line."""
    try:
        lines = [line for line in output.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("trainbook: error:")]
    return (errors or lines or [""])[-1].removeprefix("trainbook: error: ")
