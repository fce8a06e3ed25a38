"""The real `trainbook` command in subprocesses: run, archive layout, sample, config, prepare."""

import json
import time
from pathlib import Path

import pytest
import tomllib
import torch

from tests.conftest import prepared_recipe, run_cli, run_cli_on_terminal
from trainbook.checkpoint import load_state
from trainbook.config import load_config
from trainbook.data import Tokenizer
from trainbook.model import build_model, resolve

TRAIN_KEYS = {"kind", "step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
              "phases", "mem_peak_bytes", "loss_scale", "time"}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, debug_data):
    """One small run shared by the tests below (training is the slow part)."""
    tmp = tmp_path_factory.mktemp("e2e")
    recipe = prepared_recipe(tmp, debug_data)
    run_dir = tmp / "run"
    done = run_cli("run", str(recipe), "train.max_steps=6", "--run-dir", str(run_dir), cwd=tmp)
    assert done.returncode == 0, done.stderr
    return recipe, run_dir, done


def test_run_archive_layout(finished_run):
    recipe, run_dir, done = finished_run
    assert f"-> {run_dir}" in done.stdout
    assert (run_dir / "recipe.toml").read_text() == recipe.read_text()
    resolved = load_config(run_dir / "config.resolved.toml")
    assert resolved.train.max_steps == 6  # the override is in the archive
    assert resolved.model.dim == 64  # the registry entry is filled in
    assert resolved == load_config(recipe, ["train.max_steps=6"]).model_copy(update={"model": resolved.model})

    env = json.loads((run_dir / "env.json").read_text())
    for key in ("python", "torch", "host", "command", "world_size", "devices", "packages", "git"):
        assert key in env, key
    assert env["world_size"] == 1 and env["packages"]["torch"].startswith("2.")

    logs = list((run_dir / "logs").glob("rank0-*.log"))
    assert [p.name for p in logs] == [f"rank0-{time.strftime('%Y-%m-%d')}.log"]
    assert "step 6/6 loss" in logs[0].read_text()
    assert (run_dir / "tokenizer" / "tokenizer_meta.json").is_file()


def test_metrics_follow_the_contract(finished_run):
    _, run_dir, _ = finished_run
    records = _jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4, 6]  # log.every_steps = 2
    assert [r["step"] for r in evals] == [0, 3, 6]  # eval_every = 3, plus step 0 and the end
    for r in train:
        assert TRAIN_KEYS <= set(r), TRAIN_KEYS - set(r)
        assert set(r["phases"]) == {"data", "forward", "backward", "grad_sync", "optimizer", "checkpoint", "eval"}
        assert r["tokens"] == r["step"] * 256 and r["tokens_per_s"] > 0 and r["mem_peak_bytes"] > 0
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_events_and_final_checkpoint(finished_run):
    _, run_dir, _ = finished_run
    events = _jsonl(run_dir / "events.jsonl")
    assert [e["kind"] for e in events] == ["start", "checkpoint", "end"]
    assert events[1]["step"] == 6 and events[1]["path"] == "checkpoints/step-6"
    assert events[0]["pid"] > 0 and events[0]["host"]  # the process of this attempt
    assert events[2]["step"] == 6 and events[2]["status"] == "finished"  # the end marker
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-6"


def test_sample_from_the_run(finished_run):
    _, run_dir, _ = finished_run
    args = ("sample", str(run_dir), "--prompt", "BERNARDO:", "--max-new-tokens", "12", "--seed", "3")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("BERNARDO:") and len(first.stdout) > len("BERNARDO:\n")
    assert first.stdout == second.stdout  # seeded sampling
    ckpt = run_cli("sample", str(run_dir / "checkpoints" / "step-6"), "--prompt", "BERNARDO:",
                   "--max-new-tokens", "12", "--seed", "3")
    assert ckpt.stdout == first.stdout  # a checkpoint directory works as well as the run


# Longer in tokens than the shorter continuation asked for below, so a continuation cut by the
# prompt's length would lose all of it (or, for the longer one, its start).
LONG_PROMPT = "BERNARDO:\nWho's there?\n\nFRANCISCO:\nNay, answer me: stand, and unfold yourself.\n"


def _argmax_continuation(run_dir: Path, prompt_ids: list[int], n: int, eos_id: int) -> list[int]:
    """Greedy decoding written out here: the last checkpoint's model over the whole sequence, the
    argmax of the last position appended, n times or until EOS."""
    cfg = load_config(run_dir / "config.resolved.toml")
    model = build_model(cfg.model, "cpu", seed=1).eval()
    state = {"model": model.state_dict()}
    load_state(run_dir / "checkpoints" / "step-6", state)
    model.load_state_dict(state["model"])
    ids = list(prompt_ids)
    with torch.no_grad():
        while len(ids) < len(prompt_ids) + n and ids[-1] != eos_id:
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("new_tokens", [10, 60])
def test_greedy_sample_prints_the_prompt_then_the_whole_continuation(finished_run, new_tokens):
    _, run_dir, _ = finished_run
    tokenizer = Tokenizer.load(run_dir / "tokenizer")
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    assert 10 < len(prompt_ids) < 60
    expected = _argmax_continuation(run_dir, prompt_ids, new_tokens, tokenizer.eos_id)
    assert len(expected) > 5  # the model writes something before any EOS
    done = run_cli("sample", str(run_dir), "--prompt", LONG_PROMPT, "--max-new-tokens",
                   str(new_tokens), "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == LONG_PROMPT + tokenizer.decode(expected) + "\n"


def test_same_seed_gives_bitwise_identical_losses(finished_run, tmp_path):
    recipe, run_dir, _ = finished_run
    again = tmp_path / "again"
    done = run_cli("run", str(recipe), "train.max_steps=6", "--run-dir", str(again), cwd=recipe.parent)
    assert done.returncode == 0, done.stderr
    series = lambda d: [(r["kind"], r["step"], r.get("loss"), r.get("val_loss"), r.get("grad_norm"))
                        for r in _jsonl(d / "metrics.jsonl")]
    assert series(again) == series(run_dir)


def test_progress_bar_on_a_terminal_plain_lines_otherwise(recipe, tmp_path):
    code, screen = run_cli_on_terminal("run", str(recipe), "train.max_steps=4", "--run-dir", str(tmp_path / "tty"))
    assert code == 0, screen
    assert "━" in screen and "4/4" in screen and "tok/s" in screen  # the live bar
    assert "step 2/4 loss" not in screen  # no plain lines on a terminal
    done = run_cli("run", str(recipe), "train.max_steps=4", "--run-dir", str(tmp_path / "pipe"))
    assert "━" not in done.stdout
    assert [line.split(" loss")[0] for line in done.stdout.splitlines() if line.startswith("step ")] == [
        "step 2/4", "step 4/4"]


def test_fp16_overflow_is_skipped_and_recorded(recipe, tmp_path):
    """A real fp16 overflow through the CLI: after two clean steps the loss scale grows by 2**30,
    so step 3's scaled gradients overflow fp16 (inf); that step is skipped, the scale backs off by
    2**-30, and step 4 trains again. Every step is checkpointed to show step 3 changed no weight."""
    run_dir = tmp_path / "fp16"
    done = run_cli("run", str(recipe), "precision.dtype=fp16", "precision.loss_scale_init=256",
                   f"precision.loss_scale_growth={2.0**30}", "precision.loss_scale_interval=2",
                   f"precision.loss_scale_backoff={2.0**-30}", "train.max_steps=4", "log.every_steps=1",
                   "train.eval_every=0", "checkpoint.interval_steps=1", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    train = [r for r in _jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["step"], r["loss_scale"], r["skipped_steps"]) for r in train] == [
        (1, 256.0, 0), (2, 256.0, 0), (3, 2.0**38, 1), (4, 256.0, 1)]
    assert [r["grad_norm"] is None for r in train] == [False, False, True, False]  # inf: null in JSON
    skipped = [e for e in _jsonl(run_dir / "events.jsonl") if e["kind"] == "skipped_step"]
    assert [(e["step"], e["loss_scale"], e["next_loss_scale"], e["skipped_total"]) for e in skipped] == [
        (3, 2.0**38, 256.0, 1)]
    log = next((run_dir / "logs").glob("rank0-*.log")).read_text()
    assert "step 3: gradients overflowed at loss scale 2.74878e+11; step skipped, scale -> 256" in log

    cfg = load_config(run_dir / "config.resolved.toml")
    weights = {}
    for step in (2, 3, 4):
        state = {"model": build_model(resolve(cfg.model), "cpu", seed=123).state_dict()}
        load_state(run_dir / "checkpoints" / f"step-{step}", state)
        weights[step] = state["model"]
    assert all(torch.equal(weights[3][k], weights[2][k]) for k in weights[2])  # skipped: untouched
    assert not all(torch.equal(weights[4][k], weights[3][k]) for k in weights[3])  # trained again


def test_config_prints_the_resolved_recipe(recipe):
    done = run_cli("config", str(recipe), "train.max_steps=11", "model.n_layers=3")
    assert done.returncode == 0, done.stderr
    tree = tomllib.loads(done.stdout)
    assert tree["train"]["max_steps"] == 11
    assert tree["model"]["n_layers"] == 3 and tree["model"]["dim"] == 64


def test_prepare_twice_does_the_work_once(recipe):
    own = f"data.cache_dir={recipe.parent / 'own-cache'}"  # not the session's prepared cache
    first = run_cli("prepare", str(recipe), own)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1].startswith("prepared:")
    second = run_cli("prepare", str(recipe), own)
    assert second.stdout.splitlines()[-1].startswith("cached:")


def test_bench_data_compares_the_loader_with_training(recipe):
    done = run_cli("bench", "data", str(recipe), "--seconds", "1", cwd=recipe.parent)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    loader = next(line for line in lines if line.startswith("loader:"))
    assert float(loader.split()[1].replace(",", "")) > 0  # samples/s
    training = next(line for line in lines if line.startswith("training consumes"))
    assert "training probe" in training  # no earlier run of this recipe: it trained a few steps
    assert "data loading" in lines[-1]


@pytest.mark.slow
def test_embedded_default_recipe_runs(tmp_path, shakespeare_cache):
    """`trainbook run` with no recipe: the packaged Shakespeare recipe, cut to two steps."""
    done = run_cli("run", "train.max_steps=2", "train.eval_steps=1", "train.micro_batch_size=2",
                   "train.global_batch_tokens=512", f"data.cache_dir={shakespeare_cache}",
                   f"run.runs_root={tmp_path / 'runs'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_dir = next((tmp_path / "runs" / "tiny-shakespeare").iterdir())
    resolved = load_config(run_dir / "config.resolved.toml")
    assert resolved.tokenizer.vocab_size == 1024 and resolved.model.dim == 192
    assert len([r for r in _jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]) == 1


@pytest.mark.parametrize("args,message", [
    (["run", "--bogus"], "command line: No such option: --bogus (see `"),
    (["baseline", "--seed", "2"], "No such option: --seed (Possible options: --seeds, --steps)"),
    (["verify", "--steps", "0"], "Invalid value for '--steps': Input should be greater than or equal to 1"),
    (["nosuch"], "No such command 'nosuch'."),
])
def test_a_bad_command_line_is_one_line_and_exit_2(tmp_path, args, message):
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("trainbook: error: ") and message in done.stderr, done.stderr
