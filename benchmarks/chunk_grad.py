"""The chunked loss's gradient of one chunk, d loss / d logits = softmax - one-hot, two ways:
subtracting a materialised (C, V) one-hot (int64, then fp32) against subtracting the one at each
row's target in place (model/loss.py). Interleaved, best of N, with the bits compared.

    .venv/bin/python benchmarks/chunk_grad.py [--vocab 32768] [--chunk 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from trainbook.model.loss import _softmax_minus_one_hot


def with_one_hot(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.exp(logits - lse[:, None]) - F.one_hot(targets, logits.shape[1]).to(logits.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.chunk, args.vocab, generator=g)
    targets = torch.randint(0, args.vocab, (args.chunk,), generator=g)
    lse = torch.logsumexp(logits, dim=-1)
    times: dict[str, list[float]] = {"one-hot": [], "in place": []}
    for _ in range(args.repeats):
        for name, fn in (("one-hot", with_one_hot), ("in place", _softmax_minus_one_hot)):
            start = time.perf_counter()
            fn(logits, lse, targets)
            times[name].append(time.perf_counter() - start)
    old, new = min(times["one-hot"]), min(times["in place"])
    same = torch.equal(with_one_hot(logits, lse, targets), _softmax_minus_one_hot(logits, lse, targets))
    print(f"chunk gradient ({args.chunk} x {args.vocab}, fp32), best of {args.repeats} interleaved: "
          f"one-hot {old:.3f} s, in place {new:.3f} s, ratio {old / new:.2f}x; bitwise equal: {same}")


if __name__ == "__main__":
    main()
