"""The loss alone: full cross entropy against the chunked one (model/loss.py), eager and compiled.

    python benchmarks/loss.py [--tokens 16384] [--dim 256] [--vocab 2048] [--chunk 2048] [--reps 8]
                              [--pass train|eval] [--dtype fp32|bf16|fp16] [--against REV]

`--pass train` (default): forward and backward of head + cross entropy on random hidden states,
with the largest difference of loss and gradients from the eager full loss. `--pass eval`: the
forward alone under no_grad, the chunked loss as evaluation takes it (the loss alone) beside the
gradient-computing forward it took before (the training path's forward, whose gradients are then
dropped). `--dtype bf16|fp16`: under CPU autocast, fp16 with the trainer's first loss scale
(2^16). `--against REV`: also time model/loss.py as of git revision REV (read with `git show`).
Interleaved, median of --reps rounds; each line's ratio is to the first line's time, and the
last lines give each chunked way's time before over its time now.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from trainbook.model.loss import full_cross_entropy, linear_cross_entropy  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def loss_at(rev: str):
    """model/loss.py as of git revision `rev`, imported from a temporary copy."""
    text = subprocess.run(["git", "show", f"{rev}:src/trainbook/model/loss.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"loss_{rev}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--pass", dest="which", choices=("train", "eval"), default="train")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    ap.add_argument("--against", metavar="REV", help="also time model/loss.py as of this git revision")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.dim, generator=g, requires_grad=True)
    w = (torch.randn(args.vocab, args.dim, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), generator=g)

    def full(h, w, t):
        return full_cross_entropy((h @ w.t())[None], t[None])

    def chunked(fn, compiled):
        return lambda h, w, t: fn(h, w, t, args.chunk, compiled=compiled)

    old = loss_at(args.against).linear_cross_entropy if args.against else None
    ways = {}  # name -> (loss function, forward with gradients)
    if args.which == "train":
        ways["full, eager"] = full, True
        ways["full, compiled"] = torch.compile(full), True
    else:
        ways["full, eager"] = full, False
    for mode, compiled in (("eager", False), ("compiled", True)):
        if old is not None:
            ways[f"chunked, {mode} @{args.against}"] = chunked(old, compiled), args.which == "train"
        if args.which == "eval":
            ways[f"chunked, {mode}, with grads"] = chunked(linear_cross_entropy, compiled), True
        ways[f"chunked, {mode}"] = chunked(linear_cross_entropy, compiled), args.which == "train"

    def run(fn, grad):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            with contextlib.nullcontext() if grad else torch.no_grad():
                loss = fn(h, w, t)
        if args.which == "eval":
            return loss.detach(), ()
        (loss * scale).backward()
        grads = h.grad / scale, w.grad / scale
        h.grad = w.grad = None
        return loss.detach(), grads

    want = run(*ways["full, eager"])
    diffs = {}
    for name, way in ways.items():
        got = run(*way)
        diffs[name] = max([(got[0] - want[0]).abs().item(), *((a - b).abs().max().item() for a, b in zip(got[1], want[1]))])
    times = {name: [] for name in ways}
    for _ in range(args.reps):
        for name, way in ways.items():
            start = time.perf_counter()
            run(*way)
            times[name].append(time.perf_counter() - start)
    first = next(iter(ways))
    base = statistics.median(times[first])
    what = "forward + backward" if args.which == "train" else "eval forward (no_grad)"
    print(f"head + cross entropy, {what}, {args.tokens} tokens x dim {args.dim} x vocab {args.vocab}, chunks of "
          f"{args.chunk}, {args.dtype}, {torch.get_num_threads()} threads; ratio: {first} / the line")
    for name in ways:
        m = statistics.median(times[name])
        print(f"{name:>32}: {m * 1000:7.1f} ms  {base / m:5.3f}x  max |diff| {diffs[name]:.1e}")
    for mode in ("eager", "compiled"):  # before / after, in time
        now = statistics.median(times[f"chunked, {mode}"])
        for before in (f"chunked, {mode}, with grads", f"chunked, {mode} @{args.against}"):
            if before in times:
                print(f"{before} / chunked, {mode}: {statistics.median(times[before]) / now:.3f}")


if __name__ == "__main__":
    main()
