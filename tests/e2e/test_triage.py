"""NaN and loss-spike triage, proven on real failures in real `trainbook run`s (diagnose/triage.py).

The failures are caused, not described: NaN put into the output of block k's forward
(`model.block_nan`), NaN only in a step's first forward (`model.block_nan_once`: transient), a
batch of the data order that breaks the model whenever it is trained on (`data.nan_batch`: bad
data, met again by a replay), and batches of random tokens (`data.random_batch`: a loss spike).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import readme
from tests.conftest import prepared_recipe, run_cli, run_cli_error, worker_exits

pytestmark = pytest.mark.slow

QUICK = ("log.every_steps=1", "train.eval_every=0", "run.threads=1")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, debug_data) -> Path:
    """The debug recipe (2 micro-batches of 4 x 32 tokens a step) over the session's prepared data."""
    return prepared_recipe(tmp_path_factory.mktemp("triage"), debug_data)


def _run(recipe: Path, run_dir: Path, *overrides: str, fault: str | None = None, block: int = 1,
         nproc: int = 1, **env: str):
    env = {**env, **({"TRAINBOOK_FAULT": fault, "TRAINBOOK_FAULT_BLOCK": str(block)} if fault else {})}
    extra = ("--nproc", str(nproc)) if nproc > 1 else ()
    return run_cli("run", str(recipe), *QUICK, *overrides, "--run-dir", str(run_dir), *extra, cwd=recipe.parent,
                   env=env, timeout=600)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _events(run_dir: Path, *kinds: str) -> list[dict]:
    return [e for e in _records(run_dir / "events.jsonl") if not kinds or e["kind"] in kinds]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def _state(checkpoint: Path, tmp: Path) -> dict:
    """A checkpoint's tensors (DCP -> one torch file, loaded with weights_only)."""
    out = tmp / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


def _same(a: dict, b: dict) -> bool:
    """Every tensor bitwise equal (nested dicts)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.fixture(scope="module")
def clean(recipe, tmp_path_factory) -> Path:
    """The same run with no fault: what the transient and skip cases are held against."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    done = _run(recipe, run_dir, "train.max_steps=6")
    assert done.returncode == 0, done.stderr
    return run_dir


@pytest.mark.parametrize("block", [0, 1])
def test_nan_in_block_k_is_located_there_and_stops_the_run(recipe, tmp_path, block):
    run_dir = tmp_path / "nan"
    done = _run(recipe, run_dir, "train.max_steps=6", "checkpoint.interval_steps=2", fault="model.block_nan@4",
                block=block)

    assert done.returncode == 5, done.stderr  # a non-finite loss stopped, under the default policy `stop`
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainbook: error: ")]
    assert errors == [f"trainbook: error: step 4: loss is nan; first non-finite output: layers.{block} "
                      "(micro-batch 1 of 2, rank 0); reproducible: the re-run gave loss nan, grad norm nan; "
                      "training stopped; incident in incidents/step-4/"], done.stderr
    if block == 1:  # the README's transcript of this run, exactly (its `...` aside), and its exit status
        readme.assert_printed("A NaN put into block 1's output in step 4", done.stdout + done.stderr, command="trainbook run")
        assert readme.status("A NaN put into block 1's output in step 4", "trainbook run") == done.returncode
    incident = json.loads((run_dir / "incidents" / "step-4" / "incident.json").read_text())
    assert incident["kind"] == "nonfinite" and incident["action"] == "stop" and incident["rerun"]["reproducible"]
    assert incident["lr"] > 0 and incident["loss_scale"] is None and incident["micro_batches"] == 2
    assert set(incident["block_grad_norms"]) == {"embed", "layers.0", "layers.1", "norm", "output"}
    assert (run_dir / "incidents" / "step-4" / "verdict.txt").read_text() == errors[0].removeprefix(
        "trainbook: error: ") + "\n"
    # The batch as trained: 2 micro-batches of 4 rows, each row's tokens those of its source at its
    # offset, and the document the row was cut from holds the row's text.
    batch = json.loads((run_dir / "incidents" / "step-4" / "batch-dp0.json").read_text())
    rows = batch["rows"]
    assert [(r["micro_batch"], r["row"]) for r in rows] == [(m, j) for m in (1, 2) for j in range(4)]
    assert all(r["source"] == "plays" and r["matches_source"] and len(r["token_ids"]) == 33 for r in rows)
    assert all(r["text"].strip() in r["document"]["text"] and r["document"]["text"].startswith("SCENE ")
               for r in rows), rows[0]
    assert batch["global_samples_from"] == 3 * 8  # 3 steps of 2 x 4 samples came before
    # The bad step's record went out (its alert fired), no checkpoint of it was written.
    assert _losses(run_dir)[4] != _losses(run_dir)[4]  # NaN
    assert [(e["kind"], e["step"]) for e in _events(run_dir, "incident", "alert", "end")] == \
        [("incident", 4), ("alert", 4), ("end", 4)]
    assert _events(run_dir, "end")[0]["status"] == "failed"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-2"]

    # `trainbook doctor` on the directory this real NaN left: the incident's verdict and numbers.
    doctor = run_cli("doctor", str(run_dir))
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr, doctor.stderr
    out = doctor.stdout
    assert out.splitlines()[0] == f"nan/spike: {incident['verdict']}", out
    assert (f"1 incident(s); first: nonfinite at step 4: loss is nan; first non-finite output: layers.{block} "
            "(micro-batch 1 of 2, rank 0)") in out, out
    assert f"incidents/step-4/incident.json: loss nan, lr {incident['lr']:g}, grad_norm nan" in out, out
    assert "reproducible: the re-run of the step on the same batch failed again" in out


def test_skip_leaves_the_weights_as_they_were(recipe, tmp_path, clean):
    run_dir = tmp_path / "skip"
    done = _run(recipe, run_dir, "train.max_steps=6", "triage.on_nonfinite=skip", "checkpoint.interval_steps=1",
                "checkpoint.keep_last=10", fault="model.block_nan@4")

    assert done.returncode == 0, done.stderr
    assert "step 4: loss is nan; first non-finite output: layers.1 (micro-batch 1 of 2, rank 0); reproducible: " \
           "the re-run gave loss nan, grad norm nan; step skipped, weights unchanged" in done.stdout
    before, after = (_state(run_dir / "checkpoints" / f"step-{s}", tmp_path) for s in (3, 4))
    assert _same(before["model"], after["model"]) and _same(before["optim"], after["optim"])
    assert not _same(after["model"], _state(run_dir / "checkpoints" / "step-5", tmp_path)["model"])
    assert after["data"]["consumed"] == before["data"]["consumed"] + 8  # the step's data is spent
    assert [(e["step"], e["by"]) for e in _events(run_dir, "skipped_step")] == [(4, "triage")]
    losses, reference = _losses(run_dir), _losses(clean)
    assert [losses[s] for s in (1, 2, 3)] == [reference[s] for s in (1, 2, 3)]
    assert losses[5] != reference[5]  # step 5 trains weights that missed step 4's update


def test_a_transient_nan_trains_on_with_the_rerun_bitwise_as_a_clean_run(recipe, tmp_path, clean):
    run_dir = tmp_path / "transient"
    done = _run(recipe, run_dir, "train.max_steps=6", fault="model.block_nan_once@4", block=0)

    assert done.returncode == 0, done.stderr
    assert "triage: step 4: loss is nan; transient: the re-run was clean (loss " in done.stdout, done.stdout
    assert "the re-run's update was applied" in done.stdout
    assert _losses(run_dir) == _losses(clean)  # every step, step 4 (the re-run's) included
    incident = json.loads((run_dir / "incidents" / "step-4" / "incident.json").read_text())
    assert not incident["rerun"]["reproducible"] and incident["action"] == "continue"
    assert not _events(run_dir, "skipped_step")


ROLLBACK = ("train.max_steps=8", "triage.on_nonfinite=rollback", "triage.rollback_skip_batches=2",
            "checkpoint.interval_steps=2")


def test_rollback_skips_the_window_and_a_resume_does_not_replay_it(recipe, tmp_path):
    # Data batch 5 breaks the model whenever it is trained on. Step 5 meets it: back to step 4,
    # and data batches 5 and 6 (global samples 32-47) are never read: step 5 trains batch 7.
    straight = tmp_path / "straight"
    done = _run(recipe, straight, *ROLLBACK, fault="data.nan_batch@5")
    assert done.returncode == 0, done.stderr
    assert "rolled back to checkpoint step-4 and skipping the 2 batches of data after it" in done.stdout
    readme.assert_printed("whenever it is trained on (`TRAINBOOK_FAULT=data.nan_batch@5`", done.stdout, mask=True)
    rollback = _events(straight, "rollback")
    assert [(e["step"], e["to_step"], e["skipped_samples"], e["path"]) for e in rollback] == \
        [(5, 4, [32, 48], "checkpoints/step-4")]
    assert [e["step"] for e in _events(straight, "incident")] == [5]
    assert sorted(_losses(straight)) == list(range(1, 9))  # the bad step left no record

    # The same run killed as step 6 takes its data (checkpoint step-4 is the newest), resumed with the
    # bad batch still armed: the resume reads the window from events.jsonl and skips it again.
    resumed = tmp_path / "resumed"
    killed = _run(recipe, resumed, *ROLLBACK, fault="data.nan_batch@5,data.next_batch@6")
    assert killed.returncode == -9, killed.stderr
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["latest", "step-2", "step-4"]
    done = _run(recipe, resumed, *ROLLBACK, fault="data.nan_batch@5")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "triage: " not in done.stdout  # no second incident
    assert [e["kind"] for e in _events(resumed, "incident", "rollback", "resume")] == ["incident", "rollback", "resume"]
    assert _losses(resumed) == _losses(straight)  # bitwise: the same data, the same steps


def test_a_loss_spike_is_judged_by_the_robust_rule_and_skipped(recipe, tmp_path):
    run_dir = tmp_path / "spike"
    done = _run(recipe, run_dir, "train.max_steps=20", "triage.on_spike=skip", "triage.window=8", "triage.spike_z=20",
                "optim.lr=3e-3", "schedule.kind=constant", fault="data.random_batch@18")

    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("triage: "))
    assert re.fullmatch(r"triage: step 18: loss \d\.\d{4} is \d+\.\d robust sigmas above its trend \d\.\d{4} over the "
                        r"last 8 steps; every module output and gradient is finite; 8 of 8 rows of batch-dp0.json "
                        r"differ from their source's tokens; reproducible: the re-run gave loss [\d.]+, grad norm "
                        r"[\d.]+; step skipped, weights unchanged; incident in incidents/step-18/", line), line
    readme.assert_printed("(`TRAINBOOK_FAULT=data.random_batch@18`", done.stdout, mask=True)
    incident = json.loads((run_dir / "incidents" / "step-18" / "incident.json").read_text())
    assert incident["kind"] == "spike" and incident["z"] > 20 and incident["trend"] < incident["loss"]
    assert [e["step"] for e in _events(run_dir, "incident")] == [18]  # the clean steps judged nothing


def test_two_ranks_agree_on_a_nan_one_of_them_sees(recipe, tmp_path):
    # FSDP over 2 ranks; rank 1's block 1 alone puts NaN out. Both ranks skip the step together.
    run_dir = tmp_path / "fsdp"
    done = _run(recipe, run_dir, "train.max_steps=5", "triage.on_nonfinite=skip", "checkpoint.interval_steps=1",
                "checkpoint.keep_last=10", fault="model.block_nan@4", nproc=2, TRAINBOOK_FAULT_RANK="1")
    assert done.returncode == 0, done.stderr
    assert "first non-finite output: layers.1 (micro-batch 1 of 1, rank 1)" in done.stdout, done.stdout
    before, after = (_state(run_dir / "checkpoints" / f"step-{s}", tmp_path) for s in (3, 4))
    assert _same(before["model"], after["model"]) and _same(before["optim"], after["optim"])
    rows = [json.loads((run_dir / "incidents" / "step-4" / f"batch-dp{r}.json").read_text())["rows"] for r in (0, 1)]
    assert len(rows[0]) == len(rows[1]) == 4 and {r["sample"] for r in rows[0]}.isdisjoint({r["sample"] for r in rows[1]})


def test_two_context_parallel_ranks_locate_a_nan_and_count_each_gradient_once(recipe, tmp_path):
    # cp = 2: each rank holds half of every sequence and its attentions gather the other's keys
    # and values. Rank 1's block 1 puts NaN out in step 4, policy stop: that block is named, one
    # verdict line, both ranks end with exit code 5, and the one data-parallel rank's batch is
    # written once.
    stop_dir = tmp_path / "cp-stop"
    stopped = _run(recipe, stop_dir, "train.max_steps=5", "parallel.cp=2", "parallel.dp_shard=1",
                   fault="model.block_nan@4", nproc=2, TRAINBOOK_FAULT_RANK="1")
    assert stopped.returncode == 5, stopped.stderr
    verdicts = [line for line in stopped.stderr.splitlines() if line.startswith("trainbook: error: step 4:")]
    assert len(verdicts) == 1 and "first non-finite output: layers.1 (micro-batch 1 of 2, rank 1)" in verdicts[0], \
        stopped.stderr
    assert worker_exits(stopped.stderr) == {0: 5, 1: 5}, stopped.stderr
    assert sorted(p.name for p in (stop_dir / "incidents" / "step-4").glob("batch-*.json")) == ["batch-dp0.json"]

    # The NaN in step 4's first forward only: the clean re-run's update is applied. Its per-block
    # gradient norms are the global ones, each counted once (the two cp ranks hold the same sums:
    # one speaks), so together they are the step's gradient norm.
    run_dir = tmp_path / "cp-transient"
    done = _run(recipe, run_dir, "train.max_steps=5", "parallel.cp=2", "parallel.dp_shard=1",
                fault="model.block_nan_once@4", nproc=2, TRAINBOOK_FAULT_RANK="1")
    assert done.returncode == 0, done.stderr
    assert "transient: the re-run was clean" in done.stdout, done.stdout
    incident = json.loads((run_dir / "incidents" / "step-4" / "incident.json").read_text())
    blocks = incident["block_grad_norms"]
    assert {"layers.0", "layers.1"} <= blocks.keys(), blocks
    total = sum(v * v for v in blocks.values()) ** 0.5
    assert total == pytest.approx(incident["rerun"]["grad_norm"], rel=1e-5), (total, incident["rerun"])


def test_an_unknown_policy_is_bad_input(recipe, tmp_path):
    line = run_cli_error("run", str(recipe), "triage.on_spike=restart", cwd=tmp_path, watch=(recipe.parent / "runs",))
    assert line.startswith("trainbook: error: command line: triage.on_spike: ") and "'rollback'" in line, line
