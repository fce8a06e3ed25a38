"""Candidate hot-path changes to the Llama block, each timed against the block as it is.

    python benchmarks/hot_path.py [--tokens 16384] [--reps 5]

On the debug shape of the throughput comparison (dim 256, 16 heads, FFN 768, 2048-token windows),
forward + backward of one block, fp32, eager: the block as trainbook has it, against
- fused QKV: one (dim -> q + k + v) projection instead of three;
- fused gate/up: one (dim -> 2 x ffn) projection instead of w1 and w3;
- RoPE by a full-width table (x * cos + rotate_half(x) * sin) instead of two halves and a cat.
Each variant is checked to compute the same output and input gradient (max abs difference
printed), and timed interleaved with the baseline (median of --reps rounds); the ratio is printed.
A change goes into the model only if it is faster and within 1e-6.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from trainbook.config.model import ModelConfig  # noqa: E402
from trainbook.model.llama import Block, apply_rope, rope_tables  # noqa: E402
from trainbook.model.registry import resolve  # noqa: E402


def rope_full(x, cos, sin):
    """The same rotation from full-width tables: cos2 = [cos, cos], sin2 = [-sin, sin]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x2, x1), dim=-1)
    return x * cos + rotated * sin


class Variant(torch.nn.Module):
    """A block computing what `Block` computes, with one or more fusions switched on."""

    def __init__(self, block: Block, fuse_qkv: bool, fuse_ffn: bool, full_rope: bool):
        super().__init__()
        self.block, self.fuse_qkv, self.fuse_ffn, self.full_rope = block, fuse_qkv, fuse_ffn, full_rope
        a, f = block.attention, block.feed_forward
        self.wqkv = torch.nn.Parameter(torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]).detach().clone())
        self.w13 = torch.nn.Parameter(torch.cat([f.w1.weight, f.w3.weight]).detach().clone())
        self.splits = (a.wq.weight.shape[0], a.wk.weight.shape[0], a.wv.weight.shape[0])

    def forward(self, h, cos, sin, cos2, sin2):
        b, a = self.block, self.block.attention
        x = b.attention_norm(h)
        bsz, t, _ = x.shape
        if self.fuse_qkv:
            q, k, v = F.linear(x, self.wqkv).split(self.splits, dim=-1)
        else:
            q, k, v = a.wq(x), a.wk(x), a.wv(x)
        q, k, v = (z.reshape(bsz, t, -1, a.head_dim) for z in (q, k, v))
        if self.full_rope:
            q, k = rope_full(q, cos2, sin2), rope_full(k, cos2, sin2)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + a.wo(out.transpose(1, 2).reshape(bsz, t, -1))
        x = b.ffn_norm(h)
        f = b.feed_forward
        if self.fuse_ffn:
            gate, up = F.linear(x, self.w13).chunk(2, dim=-1)
        else:
            gate, up = f.w1(x), f.w3(x)
        return h + f.w2(F.silu(gate) * up)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cfg = resolve(ModelConfig(name="tiny", dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=768,
                              vocab_size=2048, max_seq_len=args.seq))
    torch.manual_seed(0)
    block = Block(cfg)
    block.init_weights(0.02, 0.02)
    cos, sin = (t[: args.seq] for t in rope_tables(cfg))
    cos2, sin2 = torch.cat([cos, cos], -1)[None, :, None], torch.cat([-sin, sin], -1)[None, :, None]
    h = torch.randn(args.tokens // args.seq, args.seq, cfg.dim, requires_grad=True)
    variants = {
        "as is": Variant(block, False, False, False),
        "fused qkv": Variant(block, True, False, False),
        "fused gate/up": Variant(block, False, True, False),
        "full-width rope": Variant(block, False, False, True),
    }

    def run(v):
        out = v(h, cos, sin, cos2, sin2)
        out.sum().backward()
        g = h.grad
        h.grad = None
        return out.detach(), g

    want = run(variants["as is"])
    times = {name: [] for name in variants}
    diffs = {}
    for name, v in variants.items():
        got = run(v)
        diffs[name] = max((got[0] - want[0]).abs().max().item(), (got[1] - want[1]).abs().max().item())
    for _ in range(args.reps):
        for name, v in variants.items():
            start = time.perf_counter()
            run(v)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["as is"])
    print(f"one block forward + backward, {args.tokens} tokens, fp32, {torch.get_num_threads()} threads")
    for name in variants:
        t = statistics.median(times[name])
        print(f"{name:>16}: {t * 1000:7.1f} ms  {base / t:5.3f}x  max |diff| {diffs[name]:.2e}")


if __name__ == "__main__":
    main()
