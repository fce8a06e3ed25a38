"""`trainbook check`: the preflight table, run as the real command on a debug recipe.

Unprepared data is a warn naming `trainbook prepare`; a wrong version lock fails `check` with
the install line and stops `run` before anything is written; a bad specifier is bad input; on
two real ranks the collectives are checked and a rank whose matmul is really slowed (the fault
point `check.slow_matmul`) is named with its host (a warn on CPU, where ranks share the cores)."""

import json
import socket

from tests.conftest import files_under, run_cli, run_cli_error, write_recipe


def _rows(stdout: str) -> dict[str, dict]:
    return {r["check"]: r for r in json.loads(stdout)["rows"]}


def test_unprepared_data_is_a_warn_naming_prepare_then_the_prepared_data_passes(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "unit.toml", corpus)  # its own cache: not the session's prepared one
    before = files_under(tmp_path)
    done = run_cli("check", str(recipe), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARN    data         not prepared yet" in done.stdout
    assert f"fix: trainbook prepare {recipe}" in done.stdout
    assert "SKIP    collectives  one rank" in done.stdout
    assert files_under(tmp_path) == before  # check writes nothing: no cache, no run directory

    assert run_cli("prepare", str(recipe), cwd=tmp_path).returncode == 0
    done = run_cli("check", str(recipe), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert rows["data"]["status"] == "pass" and "checksums valid" in rows["data"]["detail"]
    assert rows["vocab"]["status"] == "pass"
    assert rows["loader"]["status"] in ("pass", "warn") and "tokens/s from the loader" in rows["loader"]["detail"]
    assert rows["memory"]["status"] == "pass" and rows["disk"]["status"] == "pass"
    assert rows["matmul"]["status"] == "pass"
    assert not (tmp_path / "runs").exists()


def test_a_wrong_torch_lock_fails_check_with_the_fix_and_stops_run_before_it_writes(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "locked.toml", corpus, extra='[env]\ntorch = "==2.12.0"\n')
    done = run_cli("check", str(recipe), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    torch_row = next(i for i, line in enumerate(lines) if line.startswith("FAIL    torch "))
    assert "does not satisfy ==2.12.0" in lines[torch_row]
    assert lines[torch_row + 1].strip() == "fix: pip install 'torch==2.12.0'"

    line = run_cli_error("run", str(recipe), cwd=tmp_path)  # nothing written: no cache, no run
    assert line.startswith(f"trainbook: error: {recipe}: env.torch: torch ")
    assert "fix: pip install 'torch==2.12.0'" in line and "--no-check" in line

    # The --nproc launcher checks too, before any worker starts; a lock set on the command line is named so.
    line = run_cli_error("run", str(recipe), "env.torch===2.12.0", "--nproc", "2", cwd=tmp_path)
    assert line.startswith("trainbook: error: command line: env.torch: torch ")

    done = run_cli("run", str(recipe), "train.max_steps=1", "train.eval_every=0", "--no-check", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "done: 1 steps" in done.stdout


def test_a_bad_env_specifier_is_bad_input_naming_the_key(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "bad.toml", corpus, extra='[env]\ntorch = "2.13"\n')
    line = run_cli_error("check", str(recipe), cwd=tmp_path)
    assert line == (f"trainbook: error: {recipe}: env.torch: '2.13' is not a PEP 440 version specifier "
                    "(e.g. '>=2.4', '==2.13.0', '==2.13.*', '>=2.4,<3')")


def test_two_ranks_check_every_collective_and_name_the_rank_with_a_slowed_matmul(tmp_path, recipe):
    done = run_cli("check", str(recipe), "--nproc", "2", "--json", cwd=tmp_path,
                   env={"TRAINBOOK_FAULT": "check.slow_matmul", "TRAINBOOK_FAULT_RANK": "1",
                        "TRAINBOOK_FAULT_SLOWDOWN": "20"})
    assert done.returncode == 0, done.stdout + done.stderr  # on CPU an outlier is a warn
    rows = _rows(done.stdout)
    collectives = rows["collectives"]
    assert collectives["status"] in ("pass", "warn"), collectives  # warn: below the bandwidth floor
    assert "all_reduce, all_gather, reduce_scatter of 4 MiB on 2 ranks (gloo): results correct" in collectives["detail"]
    matmul = rows["matmul"]
    assert matmul["status"] == "warn", matmul
    assert f"slow: rank 1 on {socket.gethostname()} (" in matmul["detail"]
    assert "rank 0 on" not in matmul["detail"]


def test_a_rank_lost_before_the_collectives_fails_the_row_naming_it(tmp_path, recipe):
    done = run_cli("check", str(recipe), "--nproc", "2", "--json", cwd=tmp_path,
                   env={"TRAINBOOK_FAULT": "check.collectives", "TRAINBOOK_FAULT_RANK": "1"})
    assert done.returncode == 1, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert rows["collectives"]["status"] == "fail", rows["collectives"]
    # Rank 0 saw its peer go (and said so), or torchrun saw rank 1 killed first: rank 1 is named either way.
    assert rows["collectives"]["detail"].startswith("2 ranks: rank 1 on "), rows["collectives"]
    assert rows["matmul"]["status"] == "skip"
