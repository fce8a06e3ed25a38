"""PyTorch's collective flight recorder: which collective each rank is in, by sequence number.

c10d records every collective a process group issues (op, sequence number, sizes, state) in a
ring buffer when `TORCH_FR_BUFFER_SIZE` is set before the group starts; gloo (torch >= 2.13 here)
and NCCL both keep one. Two readings serve the hang watchdog (diagnose/hang.py):

- `status()`, every watchdog tick: per process group, the sequence number of the last collective
  enqueued and of the last completed (a few microseconds: no entries are serialised). A rank
  whose enqueued number is ahead of its completed one is waiting in a collective.
- `in_flight()`, `dump(path)`, `analyse(folder)`, once, when a hang is declared: the entries
  still in flight, the whole buffer for PyTorch's analyser (`torch.distributed.flight_recorder`,
  NCCL dumps only: it cannot read gloo's, whose process groups carry no names), and its report.

Sequence numbers are c10d's own per-group counters (the same numbers the flight recorder and
NCCL's timeout messages print), not a count of trainbook's collectives: FSDP, tensor parallel
and pipeline collectives are issued inside PyTorch, where a counter of our own would miss them.
Without a recorder (a torch that lacks it) `status()` falls back to c10d's per-group sequence
numbers, which say how far a rank got but not whether it is waiting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

BUFFER_ENTRIES = "2000"  # the ring buffer: the last 2000 collectives per process


def enable(backend: str) -> None:
    """Turn the recorder on for the process groups this process creates next (before
    init_process_group); an explicit setting in the environment wins."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", BUFFER_ENTRIES)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", BUFFER_ENTRIES)


def _c10d():
    import torch._C._distributed_c10d as c10d

    return c10d


def _dump_json(entries: bool) -> dict | None:
    """The recorder's JSON dump (NCCL's recorder when this build has one, else the generic one
    gloo writes to); None when there is no recorder."""
    c10d = _c10d()
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            return json.loads(fn(entries, True))
        except Exception:  # noqa: BLE001 - a recorder that is not enabled or not built: try the next
            continue
    return None


def status() -> dict[str, list[int | None]]:
    """Per process group: [last enqueued, last completed] collective sequence numbers (completed
    None when unknown)."""
    dump = _dump_json(entries=False)
    if dump is not None and dump.get("pg_status"):
        return {pg: [int(s["last_enqueued_collective"]), int(s["last_completed_collective"])]
                for pg, s in dump["pg_status"].items()}
    out: dict[str, list[int | None]] = {}
    if dist.is_initialized():
        for i, pg in enumerate(dist.distributed_c10d._world.pg_map):
            try:
                out[str(i)] = [pg._get_sequence_number_for_group(), None]
            except Exception:  # noqa: BLE001 - a group kind without sequence numbers
                pass
    return out


def in_flight() -> list[dict]:
    """The collectives this rank has issued and not completed, oldest first: op, seq, group."""
    dump = _dump_json(entries=True)
    if dump is None:
        return []
    done = {pg: int(s["last_completed_collective"]) for pg, s in dump.get("pg_status", {}).items()}
    out = []
    for e in dump.get("entries", []):
        pg_id = str(e.get("pg_id"))
        seq = int(e.get("collective_seq_id", 0))
        if e.get("is_p2p"):
            seq = int(e.get("p2p_seq_id", 0))
        if e.get("retired") or seq <= done.get(pg_id, -1) or e.get("state") == "completed":
            continue
        name = str(e.get("profiling_name", "collective"))
        group = e.get("process_group") or [pg_id, ""]
        out.append({"op": name.split(":", 1)[-1], "seq": seq, "pg": pg_id, "group": group[1] or group[0]})
    return out


def dump(path: Path) -> bool:
    """Write the whole buffer (the analyser's pickle format) to `path`; whether there was one."""
    c10d = _c10d()
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            path.write_bytes(fn(True, True))
            return True
        except Exception:  # noqa: BLE001 - not enabled for this backend: try the next
            continue
    return False


def analyse(folder: Path, prefix: str, timeout_s: float = 30.0) -> str | None:
    """PyTorch's flight-recorder analyser over the dumps `folder/<prefix><rank>`; its report, or
    None when it is not installed. Meant for NCCL dumps."""
    try:
        import torch.distributed.flight_recorder.fr_trace  # noqa: F401
    except ImportError:
        return None
    try:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder),
                               "--prefix", prefix], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"the analyser did not finish in {timeout_s:g} s"
    return done.stdout + done.stderr
