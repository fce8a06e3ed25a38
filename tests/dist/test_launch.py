"""Launching: layout errors before any process starts, two torchrun "nodes", collective timeouts."""

from __future__ import annotations

import re
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import prepared_recipe, run_cli
from trainbook.parallel.runtime import free_port


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, debug_data) -> Path:
    return prepared_recipe(tmp_path_factory.mktemp("launch"), debug_data)


BAD_LAYOUTS = [  # (arguments, what the one line must say); the debug model: 2 layers, 4 heads, 2 KV heads
    (["parallel.dp_shard=2"], "parallel: pp=1 x dp_replicate=1 x dp_shard=2 x tp=1 = 2 ranks, but the world size is 1"),
    (["parallel.tp=3", "--nproc", "2"], "parallel.dp_shard: the other degrees multiply to 3, which does not divide the world size 2"),
    (["parallel.tp=4", "parallel.dp_shard=1", "--nproc", "4"], "parallel.tp: model.n_kv_heads = 2 is not divisible by tp = 4"),
    (["model.name=tiny-moe", "parallel.tp=2", "parallel.dp_shard=1", "--nproc", "2"],
     "parallel.tp: tensor parallel of a mixture of experts (model.n_experts = 8) is not built yet; use tp = 1"),
    (["model.kv_lora_rank=16", "model.q_lora_rank=0", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
      "model.v_head_dim=8", "model.n_kv_heads=4", "parallel.tp=2", "parallel.dp_shard=1", "--nproc", "2"],
     "parallel.tp: tensor parallel of multi-head latent attention (model.kv_lora_rank = 16) is not built yet; use tp = 1"),
    (["parallel.cp=2", "parallel.dp_shard=1", "train.seq_len=30", "--nproc", "2"],
     "train.seq_len: seq_len = 30 does not split into 2 x cp x tp = 4 equal chunks"),
    (["parallel.cp=2", "parallel.dp_shard=1", "model.name=tiny-moe", "--nproc", "2"],
     "model.n_experts: context parallelism (parallel.cp = 2) with a mixture of experts is not built yet"),
    (["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_split=[1, 2]", "--nproc", "2"],
     "parallel.pp_split: [1, 2] must be 2 positive layer counts (one per stage) adding up to model.n_layers = 2"),
    (["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_microbatches=1", "--nproc", "2"],
     "parallel.pp_microbatches: 1f1b needs at least as many micro-batches as pipeline ranks (2); got 1"),
    (["--nproc", "1000"], "--nproc: 1000 processes, but this machine allows"),
    (["--nnodes", "1:2"], "--nnodes: more than one node needs --rdzv-endpoint HOST:PORT (the c10d rendezvous)"),
    (["--nnodes", "2:1"], "--nnodes: '2:1': needs 1 <= MIN <= MAX"),
    (["launch.nnodes=2"], "launch.nnodes: 2 nodes need a rendezvous: run this on every node with --rdzv-endpoint"),
    # Elastic down to one node: the layout must hold there too.
    (["parallel.dp_shard=2", "--nnodes", "1:2", "--rdzv-endpoint", "localhost:1"],
     "parallel: pp=1 x dp_replicate=1 x dp_shard=2 x tp=1 = 2 ranks, but the world size is 1"),
]


@pytest.mark.parametrize("args,message", BAD_LAYOUTS, ids=[m.split(":")[0] for _, m in BAD_LAYOUTS])
def test_bad_layouts_fail_in_one_line_before_any_process(recipe, tmp_path, args, message):
    done = run_cli("run", str(recipe), *args, "--run-dir", str(tmp_path / "run"), cwd=recipe.parent)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_the_recipes_launch_section_is_the_default_world(recipe, tmp_path):
    """`[launch] nproc_per_node = 2` without --nproc: two workers (torchrun), and plan lays out two."""
    done = run_cli("run", str(recipe), "launch.nproc_per_node=2", "train.max_steps=2", "--run-dir",
                   str(tmp_path / "run"), cwd=recipe.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "env.json").read_text())["world_size"] == 2
    planned = run_cli("plan", str(recipe), "launch.nproc_per_node=2", cwd=recipe.parent)
    assert planned.returncode == 0 and "on 2 rank(s)" in planned.stdout, planned.stdout + planned.stderr
    one = run_cli("run", str(recipe), "launch.nproc_per_node=2", "train.max_steps=2", "--nproc", "1", "--run-dir",
                  str(tmp_path / "one"), cwd=recipe.parent)  # the command line wins
    assert one.returncode == 0 and json.loads((tmp_path / "one" / "env.json").read_text())["world_size"] == 1


def test_two_torchrun_agents_as_two_nodes_train_together(recipe, tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes",
           "-m", "trainbook", "run", str(recipe), "train.max_steps=3", "log.every_steps=1", "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, cwd=recipe.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    logs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert all(a.returncode == 0 for a in agents), logs
    assert sum("done: 3 steps" in log for log in logs) == 1  # rank 0 (on either node) reports
    env_json = json.loads((run_dir / "env.json").read_text())
    assert env_json["world_size"] == 2 and env_json["parallel"]["dp_shard"] == 2
    assert sorted(p.name.split("-")[0] for p in (run_dir / "logs").iterdir()) == ["rank0", "rank1"]

    single = run_cli("run", str(recipe), "train.max_steps=3", "log.every_steps=1", "--run-dir",
                     str(tmp_path / "single"), cwd=recipe.parent)
    assert single.returncode == 0, single.stderr

    def losses(path: Path) -> list[float]:
        lines = (path / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]

    assert losses(run_dir) == pytest.approx(losses(tmp_path / "single"), rel=1e-5)


def test_a_stuck_rank_times_out_with_the_collective_named(recipe, tmp_path):
    # The hang watchdog off: what the collective timeout alone tells (tests/e2e/test_hang.py has the watchdog's).
    env = {"TRAINBOOK_FAULT": "train.after_step@2", "TRAINBOOK_FAULT_RANK": "1", "TRAINBOOK_FAULT_ACTION": "hang"}
    # The stuck rank never answers the agent's SIGTERM: it is killed `parallel.stop_grace_s` later.
    done = run_cli("run", str(recipe), "train.max_steps=6", "parallel.timeout_s=5", "parallel.hang_timeout_s=0",
                   "parallel.data_parallel=ddp", f"parallel.stop_grace_s={GRACE_S}",
                   "parallel.dp_replicate=2", "parallel.dp_shard=1", "--nproc", "2", "--run-dir",
                   str(tmp_path / "run"), cwd=recipe.parent, env=env, timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainbook: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "parallel.timeout_s: rank 0: a collective timed out after 5 s in step 3" in errors[0]
    # The agent's own log: when it sent SIGTERM to the stuck rank, and when it gave up and sent
    # SIGKILL. torch waits 30 s between them unless told otherwise (the agent waits out the grace
    # whatever the machine's speed; only a stall of the whole machine could stretch it to 30 s).
    sent = {signal: _agent_time(done.stderr, pattern) for signal, pattern in
            (("SIGTERM", r"Sending process \d+ closing signal SIGTERM"),
             ("SIGKILL", r"Unable to shutdown process \d+ via (?:15|\S*SIGTERM), forcefully exiting via (?:9|\S*SIGKILL)"))}
    assert GRACE_S <= sent["SIGKILL"] - sent["SIGTERM"] < 30, (sent, done.stderr[-3000:])


GRACE_S = 2


def _agent_time(log: str, pattern: str) -> float:
    """The time of day (s) of the agent's log line matching `pattern` (glog: `W1207 06:53:25.182000 ...`)."""
    found = re.search(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ .*" + pattern, log, flags=re.M)
    assert found, f"no agent log line matching {pattern!r}:\n{log[-3000:]}"
    hours, minutes, seconds = found.groups()
    return 3600 * int(hours) + 60 * int(minutes) + float(seconds)
