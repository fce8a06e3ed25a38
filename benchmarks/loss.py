"""The loss alone: full cross entropy against the chunked one (model/loss.py), eager and compiled.

    python benchmarks/loss.py [--tokens 16384] [--dim 256] [--vocab 2048] [--chunk 2048] [--reps 8]

Forward and backward of head + cross entropy on random hidden states, fp32, interleaved (median
of --reps rounds), with the largest difference of loss and gradients from the eager full loss.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from trainbook.model.loss import full_cross_entropy, linear_cross_entropy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.dim, generator=g, requires_grad=True)
    w = (torch.randn(args.vocab, args.dim, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), generator=g)

    def full(h, w, t):
        return full_cross_entropy((h @ w.t())[None], t[None])

    ways = {
        "full, eager": full,
        "full, compiled": torch.compile(full),
        "chunked, eager": lambda h, w, t: linear_cross_entropy(h, w, t, args.chunk),
        "chunked, compiled": lambda h, w, t: linear_cross_entropy(h, w, t, args.chunk, compiled=True),
    }

    def run(fn):
        loss = fn(h, w, t)
        loss.backward()
        grads = h.grad, w.grad
        h.grad = w.grad = None
        return loss.detach(), grads

    want = run(ways["full, eager"])
    diffs = {}
    for name, fn in ways.items():
        got = run(fn)
        diffs[name] = max((got[0] - want[0]).abs().item(), *((a - b).abs().max().item() for a, b in zip(got[1], want[1])))
    times = {name: [] for name in ways}
    for _ in range(args.reps):
        for name, fn in ways.items():
            start = time.perf_counter()
            run(fn)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["full, eager"])
    print(f"head + cross entropy, {args.tokens} tokens x dim {args.dim} x vocab {args.vocab}, chunks of {args.chunk}, "
          f"fp32, {torch.get_num_threads()} threads")
    for name in ways:
        m = statistics.median(times[name])
        print(f"{name:>18}: {m * 1000:7.1f} ms  {base / m:5.3f}x  max |diff| {diffs[name]:.1e}")


if __name__ == "__main__":
    main()
