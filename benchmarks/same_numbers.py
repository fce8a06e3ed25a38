"""Do two source trees train the same numbers, bit for bit? The proof a refactor owes.

Runs the same real `trainbook run` commands with each tree's code (`PYTHONPATH=<tree>/src`, the
one venv), over one prepared copy of the embedded default's data, and compares what they wrote:

- `default`: the embedded default recipe, 30 steps, one process;
- `fsdp2`: the same, 10 steps, `--nproc 2` (FSDP2 over gloo);
- `rollback`: a NaN batch at step 5 under `triage.on_nonfinite=rollback` (back to step 4's
  checkpoint, two batches skipped), 10 steps;
- `resumed`: killed after step 6 (a real SIGKILL), then `trainbook run --run-dir` to step 12.

Each run's fingerprint: every train record's (step, loss, grad_norm), every eval's val_loss,
and the sha256 of every file of the final checkpoint: the tensor files as written, DCP's
`.metadata` less its `storage_meta` (the folder it was written to and a random save id) with its
tables in key order, the manifest (less its `time`, its model table as built:
`families.with_options`, and so less `config_sha256`, the hash of the config's text) and the
ranks' file lists less that file's CRC. The script prints one line per run and exits 1
when any fingerprint differs.

    .venv/bin/python benchmarks/same_numbers.py --before /tmp/old-tree [--after .] [--keep DIR]

Build the old tree with `git worktree add /tmp/old-tree <commit>` (or a clone); the runs take
about three minutes a tree on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from trainbook.checkpoint.metadata import read_metadata
from trainbook.model.families import config_as_built

STEPS = ("train.eval_every=10", "log.every_steps=1")
RUNS = {
    "default": ((*STEPS, "train.max_steps=30"), {}, ()),
    "fsdp2": ((*STEPS, "train.max_steps=10", "--nproc", "2"), {}, ()),
    "rollback": ((*STEPS, "train.max_steps=10", "triage.on_nonfinite=rollback", "triage.rollback_skip_batches=2",
                  "checkpoint.interval_steps=2"), {"TRAINBOOK_FAULT": "data.nan_batch@5"}, ()),
    # Killed after step 6 (its checkpoint every 3 steps), then continued in the same directory.
    "resumed": ((*STEPS, "train.max_steps=12", "checkpoint.interval_steps=3"),
                {"TRAINBOOK_FAULT": "train.after_step@6"}, ("resume",)),
}


def trainbook(tree: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "trainbook", *args], capture_output=True, text=True, env=env,
                          cwd=tree, timeout=1800)


def fingerprint(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == ".metadata":
            # Less its storage_meta (the folder it was written to, a random save id), its tables
            # in key order (the writer threads add entries in the order they finish).
            md = read_metadata(path)
            data = repr([sorted(table.items(), key=repr) for table in
                         (md.state_dict_metadata, md.planner_data, md.storage_data)] + [md.version]).encode()
        elif path.suffix == ".json":  # the manifest less its time; it and each rank's file list less .metadata's CRC
            record = json.loads(data)
            record.pop("time", None)
            if "config" in record:  # as built (a config from before the family options), and so less
                record["config"] = config_as_built(record["config"])  # the hash of the config's text
                record.pop("config_sha256", None)
            record.get("files", record).pop(".metadata", None)
            data = json.dumps(record, sort_keys=True).encode()
        files[str(path.relative_to(ckpt))] = hashlib.sha256(data).hexdigest()
    return {
        "train": [(r["step"], r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train"],
        "eval": [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"],
        "checkpoint": {"name": ckpt.name, "files": files},
    }


def run_all(tree: Path, work: Path, cache: Path) -> dict[str, dict]:
    out = {}
    for name, (overrides, env, then) in RUNS.items():
        run_dir = work / name
        args = ("run", f"data.cache_dir={cache}", *overrides, "--run-dir", str(run_dir))
        done = trainbook(tree, *args, env=env)
        if "resume" in then:
            assert done.returncode == -9, (name, done.returncode, done.stderr[-2000:])
            done = trainbook(tree, "run", "--run-dir", str(run_dir))
        assert done.returncode == 0, (name, tree, done.stderr[-3000:])
        out[name] = fingerprint(run_dir)
        print(f"  {tree}: {name}: {len(out[name]['train'])} steps, final {out[name]['checkpoint']['name']}",
              flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old source tree (a worktree of a commit)")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--keep", type=Path, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        cache = work / "cache"
        done = trainbook(args.after, "prepare", f"data.cache_dir={cache}")
        assert done.returncode == 0, done.stderr
        sides = {side: run_all(tree.resolve(), work / side, cache)
                 for side, tree in (("before", args.before), ("after", args.after))}
    differ = 0
    for name in RUNS:
        a, b = sides["before"][name], sides["after"][name]
        same = {part: a[part] == b[part] for part in a}
        differ += not all(same.values())
        print(f"{name:9s} {len(a['train']):3d} steps: " + ", ".join(
            f"{part} {'bitwise equal' if ok else 'DIFFERENT'}" for part, ok in same.items()) +
            f" ({len(a['checkpoint']['files'])} checkpoint files)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
