"""The `trainbook` command: one subcommand per function, user errors as one line with exit code 2."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

from trainbook.errors import TrainbookError

DEFAULT_RECIPE = "recipes/tiny-shakespeare.toml"

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Reproducible large-model training recipes.",
)

RecipeArg = Annotated[
    Optional[str], typer.Argument(help=f"Recipe TOML (default: {DEFAULT_RECIPE}).", show_default=False)
]
OverridesArg = Annotated[Optional[list[str]], typer.Argument(help="key.path=value overrides.", show_default=False)]


def _recipe_and_overrides(
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


def default_recipe() -> Path:
    """The embedded default: the working directory's copy if there is one, else the packaged one."""
    local = Path(DEFAULT_RECIPE)
    return local if local.is_file() else Path(__file__).parent / "recipes" / local.name


@app.command()
def run(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    run_dir: Annotated[Optional[Path], typer.Option(
        help="Exact run directory: new or empty to start, or an existing run to continue it.")] = None,
    resume: Annotated[str, typer.Option(
        help="auto: continue --run-dir from its newest valid checkpoint | never | PATH of a checkpoint or run."
    )] = "auto",
    nproc: Annotated[int, typer.Option(
        help="Processes on this machine, started through torch.distributed.run (torchrun).", min=1)] = 1,
) -> None:
    """Train a recipe; the run is archived under runs/<name>/<time>-<id>/.

    SIGTERM or Ctrl-C saves a checkpoint after the current step and exits (128 + the signal).
    """
    from trainbook.train.run import start_run

    path, overrides = _recipe_and_overrides(recipe, overrides, _archived_config(run_dir, resume))
    if nproc > 1:
        from trainbook.parallel.launch import launch

        raise typer.Exit(launch(nproc, path, overrides, run_dir, resume))
    summary = start_run(path, overrides, run_dir, resume)
    if os.environ.get("RANK", "0") != "0":
        return  # rank 0 reports for the run
    loss = f", loss {summary['loss']:.4f}" if summary["loss"] is not None else ""
    val = f", val_loss {summary['val_loss']:.4f}" if summary["val_loss"] is not None else ""
    if summary["stopped_by"]:
        typer.echo(f"stopped by {summary['stopped_by']} at step {summary['step']}{loss}; continue with: "
                   f"trainbook run --run-dir {summary['run_dir']}")
        raise typer.Exit(128 + signal.Signals[summary["stopped_by"]].value)
    typer.echo(f"done: {summary['step']} steps{loss}{val} -> {summary['run_dir']}")


def _archived_config(run_dir: Path | None, resume: str) -> Path | None:
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


@app.command()
def prepare(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Prepare the recipe's data only: sources -> tokenizer -> token shards (cached)."""
    from trainbook.train.run import prepare_data, resolve_config

    path, overrides = _recipe_and_overrides(recipe, overrides)
    data = prepare_data(resolve_config(path, overrides), path, log=typer.echo)
    state = "cached" if data.cached else "prepared"
    splits = data.manifest["splits"]
    typer.echo(f"{state}: {data.dir} (train {splits['train']['tokens']:,} tokens, "
               f"val {splits['val']['tokens']:,} tokens)")


@app.command()
def config(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Print the resolved config (after extends and overrides) as TOML."""
    from trainbook.config import dump_toml
    from trainbook.train.run import resolve_config

    path, overrides = _recipe_and_overrides(recipe, overrides)
    typer.echo(dump_toml(resolve_config(path, overrides)), nl=False)


@app.command()
def plan(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    world_size: Annotated[int, typer.Option(help="Ranks to lay the model out on.")] = 1,
    device_memory: Annotated[Optional[str], typer.Option(help="Memory per device (e.g. 80GiB): flag layouts that will not fit.")] = None,
    json: Annotated[bool, typer.Option("--json", help="The plan as JSON.")] = False,
) -> None:
    """Show who holds what before a run: mesh, stages, placements, batch split, gradient path, memory per rank."""
    from trainbook.train.planning import plan_command

    path, overrides = _recipe_and_overrides(recipe, overrides)
    typer.echo(plan_command(path, overrides, world_size, device_memory, json))


@app.command()
def sample(
    target: Annotated[Path, typer.Argument(help="A run directory or one of its checkpoints.")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "\n",
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 200,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(min=0, help="0 keeps every token.")] = 50,
    seed: int = 0,
) -> None:
    """Generate text from a run's latest checkpoint."""
    from trainbook.train.sample import sample as generate_text

    typer.echo(generate_text(
        target, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
    ))


@app.command()
def export(
    target: Annotated[Path, typer.Argument(help="A run directory (its newest valid checkpoint) or a checkpoint.")],
    format: Annotated[str, typer.Option("--format", help="safetensors (trainbook names) | hf (LlamaForCausalLM folder).")],
    out: Annotated[Path, typer.Option(help="New folder to write; must not exist or be empty.")],
    dtype: Annotated[str, typer.Option(help="fp32 | bf16 | fp16.")] = "fp32",
) -> None:
    """Write a checkpoint's model weights as safetensors, or as a Hugging Face folder."""
    from trainbook.checkpoint.export import export_command

    typer.echo(export_command(target, format, out, dtype))


bench_app = typer.Typer(help="Measure one part of the training path alone.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("data")
def bench_data(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    seconds: Annotated[float, typer.Option(min=0.5, help="How long to read batches.")] = 5.0,
) -> None:
    """Read through the recipe's loader alone; compare with what its training consumes."""
    from trainbook.parallel import pick_device
    from trainbook.train.bench import bench_data as run_bench
    from trainbook.train.run import prepare_data, resolve_config

    path, overrides = _recipe_and_overrides(recipe, overrides)
    cfg = resolve_config(path, overrides)
    data = prepare_data(cfg, path, log=typer.echo)
    result = run_bench(cfg, data, pick_device(cfg.run.device), seconds)
    typer.echo(f"loader: {result.samples_per_s:,.0f} samples/s, {result.tokens_per_s:,.0f} tokens/s "
               f"(data.num_workers={cfg.data.num_workers})")
    typer.echo(f"training consumes {result.train_tokens_per_s:,.0f} tokens/s (from {result.train_source})")
    typer.echo(result.verdict())


@bench_app.command("comm")
def bench_comm(
    nproc: Annotated[int, typer.Option(help="Ranks on this machine.", min=1)] = 2,
    max_bytes: Annotated[str, typer.Option(help="Largest message (e.g. 64MiB).")] = "64MiB",
    iters: Annotated[int, typer.Option(help="Timed iterations per size.", min=1)] = 20,
) -> None:
    """All-reduce, all-gather and reduce-scatter bus bandwidth over message sizes (torchrun workers)."""
    from trainbook.parallel.comm_bench import bench_comm_command, parse_bytes

    try:
        size = parse_bytes(max_bytes)
    except ValueError as e:
        raise TrainbookError(str(e), where="--max-bytes") from None
    typer.echo(bench_comm_command(nproc, size, iters))


def main() -> None:
    # Under torchrun every rank runs this; rank 0 alone speaks for the run.
    speaks = os.environ.get("RANK", "0") == "0"
    try:
        code = app(standalone_mode=False)
    except TrainbookError as e:
        if speaks:
            print(f"trainbook: error: {e}", file=sys.stderr)
        code = 2
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        if speaks:
            print("trainbook: interrupted", file=sys.stderr)
        code = 130
    code = code if isinstance(code, int) else 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo can abort at interpreter exit after all work is done (DESIGN.md): skip the teardown.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
