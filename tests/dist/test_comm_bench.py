"""Collective bandwidth bench: a real 2-rank gloo run, its self-check, and nccl-tests' formulas."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from trainbook.parallel.comm_bench import (
    OPS, bus_bandwidth, format_table, message_sizes, run_comm_bench,
)

SIZES = [1024, 4096, 16384, 65536, 262144]  # 1 KiB .. 256 KiB by 4


def test_two_ranks_report_every_op_and_size(tmp_path):
    out = tmp_path / "comm.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "trainbook.parallel.comm_bench", "--device", "cpu", "--min-bytes", "1KiB",
           "--max-bytes", "256KiB", "--iters", "3", "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert out.exists(), log[-3000:]
    assert proc.returncode == 0, log[-3000:]
    result = json.loads(out.read_text())

    assert (result["backend"], result["world_size"]) == ("gloo", 2)
    records = result["records"]
    # Each record passed the bench's check on known values before it was timed.
    assert [(r["op"], r["bytes"]) for r in records] == [(op, s) for op in OPS for s in SIZES]
    for r in records:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("time_us", "algbw_GBps", "busbw_GBps"))
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(bus_bandwidth(r["op"], r["algbw_GBps"], 2))
    assert "reduce_scatter" in proc.stdout and "256 KiB" in proc.stdout  # rank 0 printed the table


def test_bus_bandwidth_matches_nccl_tests():
    # nccl-tests doc/PERFORMANCE.md: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n.
    assert bus_bandwidth("all_reduce", 100.0, 8) == pytest.approx(175.0)
    assert bus_bandwidth("all_gather", 100.0, 8) == pytest.approx(87.5)
    assert bus_bandwidth("reduce_scatter", 100.0, 8) == pytest.approx(87.5)
    assert bus_bandwidth("all_reduce", 10.0, 2) == pytest.approx(10.0)
    assert bus_bandwidth("all_gather", 10.0, 1) == 0.0  # one rank moves nothing over a link


def test_message_sizes():
    assert message_sizes(1024, 64 << 20) == [1024 * 4**k for k in range(9)]
    assert message_sizes(1024, 5000) == [1024, 4096]


@pytest.fixture
def fake_two_rank_group():
    """A world of 2 whose collectives do nothing: a broken backend seen from rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("op", OPS)
def test_broken_collective_fails_loudly(fake_two_rank_group, op):
    with pytest.raises(RuntimeError, match=f"{op} of 1 KiB float32 returned wrong values on rank 0 of 2"):
        run_comm_bench([1024], iters=1, warmup=0, dtype=torch.float32, device="cpu", ops=[op])


def test_format_table_lists_every_record():
    records = [{"op": op, "bytes": 1 << 20, "time_us": 100.0, "algbw_GBps": 10.49,
                "busbw_GBps": 10.49} for op in OPS]
    lines = format_table(records).splitlines()
    assert lines[0].split() == ["op", "size", "time_us", "algbw", "GB/s", "busbw", "GB/s"]
    assert [line.split()[:3] for line in lines if line.split()[:1] in ([op] for op in OPS)] == [
        [op, "1", "MiB"] for op in OPS]


def _hook_bench(tmp_path, env=None) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "hooks.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "trainbook.parallel.comm_bench", "--device", "cpu", "--min-bytes", "1KiB",
           "--max-bytes", "64KiB", "--iters", "2", "--warmup", "1", "--grad-compression", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_two_ranks_measure_each_gradient_compression_and_count_what_it_sends(tmp_path):
    """`bench comm --grad-compression`: every hook of parallel.grad_compression on a square fp32
    gradient of each size; the bytes a rank sends are counted at the process group: the whole
    bucket, half of it in 16 bits, PowerSGD's P and Q (rank 4) once the matrix is big enough to gain
    twice (side > 16), else the bucket whole."""
    proc, result = _hook_bench(tmp_path)
    assert proc.returncode == 0 and result is not None, (proc.stdout + proc.stderr)[-3000:]
    sides = [32 * 2**k // 2 for k in range(4)]  # 1, 4, 16, 64 KiB of fp32: 16, 32, 64, 128 a side
    expected = []
    for side in sides:
        full = side * side * 4
        psgd = 2 * side * 4 * 4 if 2 * side * 4 * 2 < side * side else full
        expected += [("none", full, full), ("bf16", full, full // 2), ("fp16", full, full // 2), ("powersgd", full, psgd)]
    assert [(r["hook"], r["bytes"], r["sent"]) for r in result["records"]] == expected
    for r in result["records"]:
        assert math.isfinite(r["time_us"]) and r["time_us"] > 0 and r["speedup"] > 0
    assert "powersgd" in proc.stdout and "128.0x" not in proc.stdout and "16.0x" in proc.stdout  # 64 KiB: 65536 / 4096


def test_a_hook_that_does_not_reduce_fails_the_bench_loudly(tmp_path):
    proc, result = _hook_bench(tmp_path, {"TRAINBOOK_FAULT": "comm.skip_reduce"})
    assert proc.returncode != 0 and result is None
    assert "none reduction of a 16x16 gradient returned wrong values on rank 0 of 2" in proc.stdout + proc.stderr
