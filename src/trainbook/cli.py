"""The `trainbook` command: one subcommand per function, user errors as one line with exit code 2."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

from trainbook.commands.recipe import DEFAULT_RECIPE
from trainbook.errors import TrainbookError

try:  # typer 0.29 parses with a copy of click of its own: its errors are not click's classes
    from typer._click.exceptions import ClickException as _ClickException
except ImportError:  # older typer: click itself
    _ClickException = click.ClickException
CLICK_ERRORS = (click.ClickException, _ClickException)
CLICK_ABORTS = (click.exceptions.Abort, typer.Abort)

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Reproducible large-model training recipes.",
)

RecipeArg = Annotated[
    Optional[str], typer.Argument(help=f"Recipe TOML (default: {DEFAULT_RECIPE}).", show_default=False)
]
OverridesArg = Annotated[Optional[list[str]], typer.Argument(help="key.path=value overrides.", show_default=False)]


@app.command()
def run(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    run_dir: Annotated[Optional[Path], typer.Option(
        help="Exact run directory: new or empty to start, or an existing run to continue it.")] = None,
    resume: Annotated[str, typer.Option(
        help="auto: continue --run-dir from its newest valid checkpoint | never | PATH of a checkpoint or run."
    )] = "auto",
    nproc: Annotated[Optional[int], typer.Option(
        help="Processes on this machine, started through torch.distributed.run (torchrun) "
             "(default: the recipe's launch.nproc_per_node).", min=1, show_default=False)] = None,
    no_check: Annotated[bool, typer.Option(
        "--no-check", help="Skip the preflight of the version lock ([env]) and free disk.")] = False,
    max_restarts: Annotated[int, typer.Option(
        help="Elastic restarts: when a worker dies, restart the group from the newest checkpoint, "
             "up to this many times.", min=0)] = 0,
    nnodes: Annotated[Optional[str], typer.Option(
        help="Nodes: N, or MIN:MAX to continue on fewer when one is lost (needs --rdzv-endpoint) "
             "(default: the recipe's launch.nnodes).", show_default=False)] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(
        help="HOST:PORT of the c10d rendezvous every node's launcher meets at.")] = None,
    rdzv_id: Annotated[Optional[str], typer.Option(
        help="The run's rendezvous id, the same on every node (default: the run directory's name).")] = None,
) -> None:
    """Train a recipe; the run is archived under runs/<name>/<time>-<id>/.

    SIGTERM or Ctrl-C saves a checkpoint after the current step and exits (128 + the signal).
    Exit codes: 0 done, 1 unexpected error, 2 bad input, 3 out of memory, 4 hang, 5 non-finite
    loss, 6 restarts spent on a repeated failure, 128+N signal N.
    """
    from trainbook.commands.launch import Elastic
    from trainbook.commands.run import run_command

    elastic = Elastic(max_restarts, nnodes, rdzv_endpoint, rdzv_id)
    text, code = run_command(recipe, overrides, run_dir, resume, nproc, check=not no_check, elastic=elastic)
    if text:
        typer.echo(text)
    raise typer.Exit(code)


@app.command()
def prepare(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Prepare the recipe's data only: sources -> tokenizer -> token shards (cached)."""
    from trainbook.commands.prepare import prepare_command

    typer.echo(prepare_command(recipe, overrides, log=typer.echo))


@app.command()
def config(recipe: RecipeArg = None, overrides: OverridesArg = None) -> None:
    """Print the resolved config (after extends and overrides) as TOML."""
    from trainbook.commands.prepare import config_command

    typer.echo(config_command(recipe, overrides), nl=False)


@app.command()
def plan(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    world_size: Annotated[Optional[int], typer.Option(
        help="Ranks to lay the model out on (default: the recipe's launch.nnodes x launch.nproc_per_node).",
        show_default=False)] = None,
    device_memory: Annotated[Optional[str], typer.Option(help="Memory per device (e.g. 80GiB): flag layouts that will not fit.")] = None,
    json: Annotated[bool, typer.Option("--json", help="The plan as JSON.")] = False,
) -> None:
    """Show who holds what before a run: mesh, stages, placements, batch split, gradient path, memory per rank."""
    from trainbook.commands.plan import plan_command
    from trainbook.commands.recipe import recipe_and_overrides

    path, overrides = recipe_and_overrides(recipe, overrides)
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
    from trainbook.commands.sample import sample as generate_text

    typer.echo(generate_text(
        target, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
    ))


@app.command("eval")
def eval_(
    target: Annotated[Path, typer.Argument(metavar="RUN|CKPT", help="A run directory (its newest valid checkpoint) or a checkpoint.")],
    data: Annotated[Path, typer.Option(help="JSONL of records with a `prompt` (a string or a list of messages) "
                                            "or `messages` ending with the user's turn; other fields go to the scorer.")],
    scorer: Annotated[str, typer.Option(help="module:function called as fn(prompts, completions, **columns) -> "
                                             "list[float] (e.g. trainbook.rewards:exact_answer).")],
    samples: Annotated[int, typer.Option(min=1, help="Completions per prompt.")] = 1,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy; otherwise sampled from the whole distribution.")] = 0.0,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    seed: Annotated[int, typer.Option(help="Completion k of the file is sampled with seed + k.")] = 0,
    json: Annotated[bool, typer.Option("--json", help="Print the archived result as JSON.")] = False,
) -> None:
    """Generate a completion for each prompt, score them, and archive the result as RUN/evals/<time>.json
    (mean score, accuracy = share of scores >= 1, settings, every prompt, completion and score)."""
    from trainbook.commands.eval import eval_command

    typer.echo(eval_command(target, data, scorer, samples=samples, temperature=temperature,
                            max_new_tokens=max_new_tokens, seed=seed, as_json=json))


@app.command()
def export(
    target: Annotated[Path, typer.Argument(help="A run directory (its newest valid checkpoint) or a checkpoint.")],
    format: Annotated[str, typer.Option("--format", help="safetensors (trainbook names) | hf (a Hugging Face folder of the model's family: Llama, Qwen2, Qwen3; LoRA merged) | peft (a LoRA run's adapters in PEFT's layout).")],
    out: Annotated[Path, typer.Option(help="New folder to write; must not exist or be empty.")],
    dtype: Annotated[str, typer.Option(help="fp32 | bf16 | fp16.")] = "fp32",
) -> None:
    """Write a checkpoint's model weights as safetensors, as a Hugging Face folder, or its LoRA adapters for PEFT."""
    from trainbook.commands.export import export_command

    typer.echo(export_command(target, format, out, dtype))


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN", help="A run directory.")],
    out: Annotated[Optional[Path], typer.Option(help="HTML file to write (default: RUN/report.html).")] = None,
) -> None:
    """One self-contained HTML report of a run: curves, phases, memory, layers, events."""
    from trainbook.commands.report import report_command

    typer.echo(report_command(run_dir, out))


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(metavar="RUN...", help="Two or more run directories.")],
    out: Annotated[Optional[Path], typer.Option(help="HTML file to write (default: ./compare.html).")] = None,
) -> None:
    """Runs side by side: config keys that differ, who is ahead per metric, curves overlaid."""
    from trainbook.commands.compare import compare_command

    typer.echo(compare_command(run_dirs, out))


@app.command()
def doctor(run_dir: Annotated[Path, typer.Argument(metavar="RUN", help="A run directory.")]) -> None:
    """Post-mortem of a run: healthy, data/compute/communication/checkpoint-bound, straggler, OOM,
    NaN/spike, hang or died, with the evidence and the next step. Exit 0 healthy, 1 a problem."""
    from trainbook.commands.doctor import doctor_command

    text, code = doctor_command(run_dir)
    typer.echo(text)
    raise typer.Exit(code)


@app.command("runs")
def list_runs(
    root: Annotated[Path, typer.Option(help="Folder holding the run archive.")] = Path("runs"),
    where: Annotated[Optional[list[str]], typer.Option(
        help="key.path=value: only runs whose resolved config has it (repeatable).")] = None,
    sort: Annotated[Optional[str], typer.Option(
        help="name | start | status | steps | loss | val_loss | tokens_per_s (best first).")] = None,
) -> None:
    """The run archive as a table: name, start, status, steps, final loss, val loss, tokens/s."""
    from trainbook.commands.runs import runs_command

    typer.echo(runs_command(root, where or [], sort))


@app.command()
def check(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    nproc: Annotated[int, typer.Option(help="Ranks to probe on this machine (torchrun workers).", min=1)] = 1,
    min_busbw: Annotated[Optional[float], typer.Option(
        help="All-reduce bus bandwidth floor in GB/s (default: by device).", min=0)] = None,
    json: Annotated[bool, typer.Option("--json", help="The rows as JSON.")] = False,
) -> None:
    """Preflight: version lock, devices and memory, disk, data, collectives, per-rank matmul.

    A table of pass/warn/fail with the fix for each; exit code 0 when all pass or warn, 1 on a fail.
    """
    from trainbook.commands.check import check_command

    text, code = check_command(recipe, overrides, nproc, json, min_busbw)
    typer.echo(text)
    raise typer.Exit(code)


@app.command()
def baseline(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    seeds: Annotated[int, typer.Option(help="Runs, one per seed: the recipe's run.seed and the next ones.", min=2)] = 5,
    k: Annotated[float, typer.Option(help="Band half-width in sample standard deviations over the seeds.", min=0)] = 3.0,
    floor: Annotated[float, typer.Option(
        help="Narrowest band half-width, as a fraction of the mean (where the seeds nearly agree).", min=0)] = 0.005,
    steps: Annotated[Optional[int], typer.Option(
        help="Measure only the first N steps (schedule unchanged); default: the whole recipe.", min=1)] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="File to write (default: baselines/<name>.json beside the recipe).")] = None,
) -> None:
    """Run the recipe once per seed and write its baseline: loss and val loss per logged step with a
    band (mean +- k sd), the first seed's exact series, tokens/s, peak memory and the environment."""
    from trainbook.commands.baseline import baseline_command

    text, code = baseline_command(recipe, overrides, seeds, k, floor, steps, out, log=typer.echo)
    typer.echo(text)
    raise typer.Exit(code)


@app.command()
def verify(
    target: Annotated[Optional[str], typer.Argument(
        metavar="[RECIPE|RUN]", help=f"A recipe to run (default: {DEFAULT_RECIPE}) or a finished run directory.",
        show_default=False)] = None,
    overrides: OverridesArg = None,
    steps: Annotated[Optional[int], typer.Option(
        help="Judge the first N steps only (a recipe is run to step N, its schedule unchanged).", min=1)] = None,
    baseline: Annotated[Optional[Path], typer.Option(
        "--baseline", help="Baseline file (default: baselines/<name>.json beside the recipe).")] = None,
) -> None:
    """Run a recipe (or read a run) and judge it against its baseline: bit for bit where the
    environment and config are the baseline's, within the band elsewhere. Exit 0 pass, 1 fail, 2 bad input."""
    from trainbook.commands.verify import verify_command

    text, code = verify_command(target, overrides, steps, baseline)
    typer.echo(text)
    raise typer.Exit(code)


@app.command()
def sweep(
    recipe: RecipeArg = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(
        help="key.path=a,b,c: an axis of the grid (every combination runs); key.path=value: every point.",
        show_default=False)] = None,
    parallel: Annotated[int, typer.Option(help="Points run at a time.", min=1)] = 1,
    out: Annotated[Optional[Path], typer.Option(
        help="Sweep directory (default: <runs_root>/<name>/sweep-<time>/).")] = None,
) -> None:
    """Run a grid of overrides, archived under one sweep directory, with a summary by final val
    loss and a comparison; a failed point is recorded and the others go on. Exit 1 if any failed."""
    from trainbook.commands.sweep import sweep_command

    text, code = sweep_command(recipe, overrides, parallel, out, log=typer.echo)
    typer.echo(text)
    raise typer.Exit(code)


bench_app = typer.Typer(help="Measure one part of the training path alone.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("data")
def bench_data(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    seconds: Annotated[float, typer.Option(min=0.5, help="How long to read batches.")] = 5.0,
) -> None:
    """Read through the recipe's loader alone; compare with what its training consumes."""
    from trainbook.commands.bench import bench_data_command

    typer.echo(bench_data_command(recipe, overrides, seconds, log=typer.echo))


@bench_app.command("model")
def bench_model(
    recipe: RecipeArg = None,
    overrides: OverridesArg = None,
    steps: Annotated[int, typer.Option(help="Timed steps after one warm-up step.", min=1)] = 5,
    json_out: Annotated[str | None, typer.Option("--json", help="Also write the figures to this JSON file.")] = None,
) -> None:
    """The recipe's model alone on synthetic tokens: tokens/s, MFU, step split, peak memory."""
    from trainbook.commands.bench_model import bench_model_command

    typer.echo(bench_model_command(recipe, overrides, steps, json_out))


@bench_app.command("comm")
def bench_comm(
    nproc: Annotated[int, typer.Option(help="Ranks on this machine.", min=1)] = 2,
    max_bytes: Annotated[str, typer.Option(help="Largest message (e.g. 64MiB).")] = "64MiB",
    iters: Annotated[int, typer.Option(help="Timed iterations per size.", min=1)] = 20,
    grad_compression: Annotated[bool, typer.Option(
        "--grad-compression", help="DDP's gradient reduction under each parallel.grad_compression instead: "
        "bytes sent, time and speed-up per hook.")] = False,
) -> None:
    """All-reduce, all-gather and reduce-scatter bus bandwidth over message sizes (torchrun workers)."""
    from trainbook.commands.bench import bench_comm_command

    typer.echo(bench_comm_command(nproc, max_bytes, iters, grad_compression=grad_compression))


def main() -> None:
    # Under torchrun every rank runs this; rank 0 alone speaks for the run.
    speaks = os.environ.get("RANK", "0") == "0"
    try:
        code = app(standalone_mode=False)
    except TrainbookError as e:
        if speaks:
            print(f"trainbook: error: {e}", file=sys.stderr)
        code = e.exit_code
    except CLICK_ERRORS as e:
        if speaks:  # one line, as for every other bad input: what is wrong, and where to look
            command = e.ctx.command_path if getattr(e, "ctx", None) is not None else "trainbook"
            print(f"trainbook: error: command line: {e.format_message()} (see `{command} --help`)", file=sys.stderr)
        code = e.exit_code
    except (*CLICK_ABORTS, KeyboardInterrupt):
        if speaks:
            print("trainbook: interrupted", file=sys.stderr)
        code = 130
    code = code if isinstance(code, int) else 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # No teardown after a finished run: the ranks have met at a barrier and left the process
        # group to this exit (Runtime.finish); gloo's teardown can abort (DESIGN.md).
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
