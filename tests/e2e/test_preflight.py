"""`trainbook run --nproc N` checks everything once, before any process starts: a bad recipe is
one line, exit code 2, and nothing is written; the default recipe runs unchanged on 1, 2 and 4
processes with the same global batch and the same losses (within the layout tolerance)."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, write_recipe


def _fails_before_anything(tmp_path: Path, *args: str) -> str:
    done = run_cli("run", *args, f"run.runs_root={tmp_path / 'runs'}", "--nproc", "2", cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    # One line from the launcher: no worker started (each would print its own, or a traceback).
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "[rank" not in done.stderr and "torch.distributed" not in done.stderr
    assert not (tmp_path / "runs").exists()  # no run directory, no logs
    return lines[0]


def test_a_batch_that_does_not_split_over_the_ranks_names_the_fix(tmp_path):
    line = _fails_before_anything(tmp_path, "train.micro_batch_size=8", f"data.cache_dir={tmp_path / 'cache'}")
    assert "tiny-shakespeare.toml: train.global_batch_tokens:" in line
    assert "set train.micro_batch_size=auto, or train.micro_batch_size=4" in line
    assert not (tmp_path / "cache").exists()  # refused before the data was touched


def test_pipeline_with_document_packing_is_refused_before_the_group_starts(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "r.toml", corpus)
    line = _fails_before_anything(tmp_path, str(recipe), "parallel.pp=2", "parallel.dp_shard=1",
                                  "data.packing=document")
    assert line.startswith(f"trainbook: error: {recipe}: data.packing:")
    assert not (tmp_path / "cache").exists()


def test_fewer_samples_than_one_batch_of_every_rank_is_found_by_the_launcher(tmp_path, corpus):
    """Needs the data: the launcher prepares it (the cache), then refuses before any worker."""
    recipe = write_recipe(tmp_path / "r.toml", corpus)
    line = _fails_before_anything(tmp_path, str(recipe), "train.seq_len=512", "model.max_seq_len=512",
                                  "train.eval_every=0", "train.micro_batch_size=64",
                                  "train.global_batch_tokens=65536")
    assert f"{recipe}: train.seq_len:" in line and "fewer than one batch of 128" in line


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory, shakespeare_cache) -> dict[int, list[dict]]:
    """The default recipe, unchanged but shortened, on 1, 2 and 4 processes: metrics by world size."""
    root = tmp_path_factory.mktemp("default-runs")
    out = {}
    for nproc in (1, 2, 4):
        run_dir = root / f"nproc{nproc}"
        done = run_cli("run", "train.max_steps=4", "train.eval_every=0", f"data.cache_dir={shakespeare_cache}",
                       "log.every_steps=1", "--run-dir", str(run_dir), "--nproc", str(nproc), cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        resolved = (run_dir / "config.resolved.toml").read_text()
        out[nproc] = [r for r in records if r["kind"] == "train"], resolved
    return out


def test_the_default_recipe_runs_on_1_2_and_4_processes_with_the_same_batch(default_runs):
    base, _ = default_runs[1]
    assert [r["step"] for r in base] == [1, 2, 3, 4]
    for nproc, micro_batch in ((1, 8), (2, 4), (4, 2)):
        records, resolved = default_runs[nproc]
        assert f"micro_batch_size = {micro_batch}\n" in resolved  # auto: each rank's share
        assert [r["tokens"] for r in records] == [2048 * s for s in (1, 2, 3, 4)]  # one global batch
        for ours, theirs in zip(records, base):
            # FSDP sums the same gradients in another order: equal within rounding.
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), (nproc, ours["step"])
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4), (nproc, ours["step"])
