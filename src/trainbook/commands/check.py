"""`trainbook check RECIPE [--nproc N]`: preflight, a table of pass / warn / fail with the fix for each.

In order, cheapest first:
- the version lock (`[env]`) against what is installed, with the install line that fixes it;
- the devices `run.device` and `--nproc` need, and free memory against `plan`'s per-rank estimate;
- free disk for `checkpoint.keep_last` checkpoints of this model (plus the one being written);
- the data: prepared and its manifest and shard checksums valid (not prepared yet is a warn
  naming `trainbook prepare`), enough samples for a batch, the tokenizer within the model's
  vocabulary, and the loader against what training consumes (`bench data`);
- the ranks (`diagnose/probe_worker.py` under torchrun): every collective's result checked and
  its bus bandwidth against a floor; a per-rank matmul probe with outlier ranks named (a fail
  on accelerators; a warn on CPU, where the ranks share one host's cores).

Exit code 0 when everything passes or warns, 1 on any fail, 2 on bad input (the recipe, overrides
or layout). `run` runs the cheap part first (`gate`): the version lock and the disk. The data and
vocabulary rows are `run`'s own pre-flight already (it prepares missing data, and refuses a
tokenizer larger than the model's vocabulary), so `gate` (commands/preflight.py) leaves them to it.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainbook.commands.bench import DataBench, loader_rate, training_rate
from trainbook.commands.launch import max_processes
from trainbook.commands.recipe import recipe_and_overrides
from trainbook.commands.resolve import Resolved, resolve
from trainbook.config import load_config
from trainbook.data import Prepared, check_train_split, check_val_split, find_prepared
from trainbook.diagnose.preflight import (
    Row, disk_row, free_memory, matmul_gflops, matmul_rows, memory_row, render, version_rows,
)
from trainbook.errors import TrainbookError, one_line
from trainbook.faults import fault_active
from trainbook.parallel.comm_bench import human_bytes
from trainbook.parallel.device import pick_device
from trainbook.parallel.plan import make_plan
from trainbook.runs import cpu_name

# All-reduce bus bandwidth below which the collectives row warns (GB/s, nccl-tests' busbw):
# gloo over loopback on a loaded CPU host still moves hundreds of MB/s; NVLink or PCIe many GB/s.
BUSBW_FLOOR_GBPS = {"cpu": 0.05, "cuda": 5.0, "npu": 5.0}
PROBE_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20, "npu": 64 << 20}
LOADER_SECONDS = 1.0
TRAIN_PROBE_STEPS = 2  # after a warm-up step; `bench data` takes 4


def check_command(recipe: str | None, overrides: list[str] | None, nproc: int = 1, as_json: bool = False,
                  min_busbw: float | None = None) -> tuple[str, int]:
    """What `trainbook check` prints and its exit code."""
    start = time.perf_counter()
    if nproc < 1:
        raise TrainbookError(f"must be at least 1, got {nproc}", where="--nproc")
    path, overrides = recipe_and_overrides(recipe, overrides)
    cfg = load_config(path, overrides)  # bad input stops here: exit 2
    rows = version_rows(cfg.env)
    device, devices = device_row(cfg.run.device, nproc)
    rows.append(devices)
    res = resolve(path, overrides, nproc, local_ranks=nproc if device is not None else None)
    plan = make_plan(res.plan_inputs(), res.dims)
    if device is not None:
        rows.append(memory_row(plan["memory"]["largest"]["total"], *free_memory(device, nproc)))
    rows.append(disk_row(Path(cfg.run.runs_root), plan["model"]["params"], cfg.checkpoint.keep_last))
    rows += data_rows(res, device, path, overrides)
    if devices.status == "fail":
        rows.append(Row("ranks", "skip", "no devices to probe (see devices)"))
    elif nproc == 1:
        rows.append(Row("collectives", "skip", "one rank: nothing to communicate (check --nproc N for the ranks)"))
        mine = {"rank": 0, "host": socket.gethostname(), "gflops": matmul_gflops(device, repeat=_slowdown())}
        rows += matmul_rows([mine], device.type)
    else:
        rows += rank_rows(device, nproc, min_busbw)

    seconds = time.perf_counter() - start
    code = 1 if any(r.status == "fail" for r in rows) else 0
    if as_json:
        return json.dumps({"recipe": str(path), "nproc": nproc, "device": str(device) if device else None,
                           "rows": [r.as_dict() for r in rows], "seconds": seconds, "exit_code": code}, indent=1), code
    title = f"check: {path} on {nproc} rank{'s' * (nproc > 1)} ({device.type if device else 'no device'})"
    return render(title, rows, seconds), code


# ---- devices --------------------------------------------------------------------------------

def device_row(kind: str, nproc: int) -> tuple[torch.device | None, Row]:
    """The device `run.device` picks and whether it holds `nproc` ranks; None when it is absent."""
    try:
        device = pick_device(kind)
    except TrainbookError as e:
        return None, Row("devices", "fail", e.message, "run on a machine that has one, or set run.device=auto",
                         "run.device")
    most = max_processes(device)
    if device.type == "cpu":
        detail = f"cpu: {os.cpu_count()} cores ({cpu_name()}), {nproc} rank(s)"
    else:
        backend = getattr(torch, device.type)
        names = sorted({backend.get_device_name(i) for i in range(backend.device_count())})
        detail = f"{backend.device_count()} x {', '.join(names)}; {nproc} rank(s)"
    if nproc > most:
        return device, Row("devices", "fail", detail + f": more ranks than this machine allows ({most})",
                           f"--nproc {most} or fewer", "run.device")
    return device, Row("devices", "pass", detail, key="run.device")


# ---- data -----------------------------------------------------------------------------------

def data_rows(res: Resolved, device: torch.device | None, path: Path, overrides: list[str]) -> list[Row]:
    """Prepared data (and its checksums), enough of it for a batch, the vocabulary, the loader."""
    cfg = res.cfg
    damaged: list[str] = []
    try:
        data = find_prepared(cfg.data, cfg.tokenizer, seed=cfg.run.seed, log=damaged.append)
    except TrainbookError as e:
        return [Row("data", "fail", e.message, "fix the data sources or tokenizer path",
                    e.where or "data.sources")]
    if data is None:
        prepare = "trainbook prepare " + shlex.join([str(path), *overrides])
        why = damaged[0].removesuffix("; preparing again") if damaged else "not prepared yet"
        return [Row("data", "warn", why, f"{prepare} (or let `trainbook run` prepare it first)",
                    "data.cache_dir"), _vocab_row(cfg.tokenizer.vocab_size if cfg.tokenizer.kind == "train_bpe"
                                                  else None, cfg.model.vocab_size, trained=True),
                Row("loader", "skip", "needs the prepared data")]
    rows = [_prepared_row(data, cfg.data.cache_dir)]
    t = cfg.train
    try:
        check_train_split(data.train, t.seq_len, t.micro_batch_size, res.dims.dp, cfg.data.packing)
        if t.eval_every > 0:
            check_val_split(data.val, t.seq_len, cfg.data.packing)
    except TrainbookError as e:
        rows.append(Row("batch", "fail", e.message, "more data, or a smaller train.seq_len / micro_batch_size",
                        e.where))
    rows.append(_vocab_row(data.tokenizer.vocab_size, cfg.model.vocab_size, trained=False))
    rows.append(_loader_row(res, data, device))
    return rows


def _prepared_row(data: Prepared, cache_dir: str) -> Row:
    m = data.manifest
    train = sum(len(s) for s in data.train.values())
    return Row("data", "pass", f"prepared: {train:,} train / {len(data.val):,} val tokens from "
               f"{len(m['sources'])} source(s); manifest and shard checksums valid ({data.dir})", key="data.cache_dir")


def _vocab_row(tokens: int | None, rows: int, trained: bool) -> Row:
    which = "the tokenizer to be trained has" if trained else "the tokenizer has"
    if tokens is None:
        return Row("vocab", "skip", "the tokenizer is read when the data is prepared", key="model.vocab_size")
    if tokens > rows:
        return Row("vocab", "fail", f"{which} {tokens} tokens but the model only {rows} embedding rows",
                   f"model.vocab_size={tokens} or more", "model.vocab_size")
    return Row("vocab", "pass", f"{which} {tokens} tokens; the model {rows} embedding rows", key="model.vocab_size")


def _loader_row(res: Resolved, data: Prepared, device: torch.device | None) -> Row:
    """One rank's loader against one rank's training (`trainbook bench data`, shortened)."""
    if device is None:
        return Row("loader", "skip", "no device to train on")
    if res.dims.tp > 1 or res.dims.pp > 1:
        return Row("loader", "skip", "measured on tp = pp = 1 layouts; see trainbook bench data")
    _, loader_tps = loader_rate(res.cfg, data, LOADER_SECONDS)
    train_tps, source = training_rate(res.cfg, data, device, probe_steps=TRAIN_PROBE_STEPS)
    bench = DataBench(0.0, loader_tps, train_tps, source)
    detail = (f"{bench.tokens_per_s:,.0f} tokens/s from the loader, training consumes "
              f"{bench.train_tokens_per_s:,.0f} per rank ({bench.headroom:,.{0 if bench.headroom >= 10 else 1}f}x)")
    if bench.headroom < 1.5:
        return Row("loader", "warn", detail, bench.verdict(), "data.num_workers")
    return Row("loader", "pass", detail, key="data.num_workers")


# ---- the ranks ------------------------------------------------------------------------------

def _slowdown() -> int:
    return int(os.environ.get("TRAINBOOK_FAULT_SLOWDOWN", "10")) if fault_active("check.slow_matmul", 0) else 1


def rank_rows(device: torch.device, nproc: int, min_busbw: float | None, timeout_s: float = 300) -> list[Row]:
    """Collectives and matmul on `nproc` ranks (diagnose/probe_worker.py under torchrun)."""
    floor = BUSBW_FLOOR_GBPS[device.type] if min_busbw is None else min_busbw
    size = PROBE_BYTES[device.type]
    # Each rank's share of the cores, as `run --nproc` gives its workers (torchrun would give one).
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    with tempfile.TemporaryDirectory(prefix="trainbook-check-") as tmp:
        out = Path(tmp) / "probe.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "trainbook.diagnose.probe_worker", "--json", str(out), "--bytes", str(size),
               "--device", device.type]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": threads})
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its workers
            log = proc.communicate()[0] + f"\ntimed out after {timeout_s:.0f} s"
        if not out.is_file():
            errors = {int(p.name.removesuffix(".err").rpartition("rank")[2]): p.read_text()
                      for p in Path(tmp).glob("probe.json.rank*.err")}
            return [Row("collectives", "fail", f"{nproc} ranks: {one_line(_failure(errors, log, nproc), 300)}",
                        "check the interconnect and the backend's environment (NCCL_DEBUG=INFO shows NCCL's view)"),
                    Row("matmul", "skip", "the ranks did not get that far")]
        result = json.loads(out.read_text())
    records = result["collectives"]
    ops = ", ".join(r["op"] for r in records)
    busbw = next(r["busbw_GBps"] for r in records if r["op"] == "all_reduce")
    detail = (f"{ops} of {human_bytes(records[0]['bytes'])} on {nproc} ranks ({result['backend']}): results "
              f"correct; all_reduce busbw {busbw:.3g} GB/s (floor {floor:g})")
    rows = [Row("collectives", "pass", detail) if busbw >= floor else
            Row("collectives", "warn", detail, "a slow link: check the interconnect (trainbook bench comm "
                f"--nproc {nproc} for every size), or lower the floor with --min-busbw")]
    return rows + matmul_rows(result["ranks"], device.type)


def _failure(errors: dict[int, str], log: str, nproc: int) -> str:
    """Why the probe ranks wrote no result: a collective's wrong values; else the ranks that ended
    without a word (a rank lost) while the others wrote what they saw; else torchrun's root cause."""
    wrong = [e for e in errors.values() if "wrong values" in e]
    if wrong:
        return wrong[0]
    silent = [r for r in range(nproc) if r not in errors]
    if errors and silent:
        seen = next(iter(errors.values()))
        return (f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} on {socket.gethostname()} ended "
                f"without a result; the others saw: {seen}")
    if "Root Cause" in log:
        return _root_cause(log)
    return next(iter(errors.values()), None) or _last_line(log)


def _root_cause(log: str) -> str:
    """torchrun's "Root Cause (first observed failure)" as one line: which rank, where, how it ended."""
    fields = {}
    for line in log.partition("Root Cause")[2].splitlines():
        key, sep, value = line.strip().partition(":")
        if sep and key.strip() in ("host", "rank", "exitcode", "traceback"):
            fields.setdefault(key.strip(), value.strip())
    rank = fields.get("rank", "?").split()[0]
    how = fields.get("traceback", "")
    how = how if how and "To enable traceback" not in how else f"exit code {fields.get('exitcode', '?').split()[0]}"
    return f"rank {rank} on {fields.get('host', '?')} ended before the collectives were done: {how}"


def _last_line(log: str) -> str:
    lines = [line for line in log.splitlines() if line.strip()]
    return one_line(lines[-1]) if lines else "the ranks wrote no result"
