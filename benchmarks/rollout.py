"""Rollout speed: trainbook's batched sampler (model/sampler.py, KV cache) against transformers'
`generate` with its KV cache, on the same model, prompts, batch and lengths, side by side in one
process (issue 29).

A tiny random Hugging Face Llama is built from a config and saved; trainbook loads the same
folder (`model_config_from_hf` + `load_hf_weights`). Both decode greedily (HF's `do_sample=False`;
trainbook's temperature 0) the same left-padded batch of random prompts of uneven length for
exactly `--new` tokens (no stop token on either side), and both are timed alternately, `--repeats`
times each; the ratio uses the best time of each side. Also printed: how many of the batch's
greedy completions agree token for token between the two implementations (a check of the cache
against transformers'; near-ties of a random model may differ in a token or two).

    .venv/bin/python benchmarks/rollout.py [--batch 32] [--new 64] [--dim 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

from trainbook.model.hf_import import load_hf_weights, model_config_from_hf
from trainbook.model.llama import build_model
from trainbook.model.sampler import LocalSampler, SamplingParams


def hf_model(folder: Path, args) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=3 * args.dim, num_hidden_layers=args.layers,
        num_attention_heads=args.dim // 32, num_key_value_heads=max(1, args.dim // 64),
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model.eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new", type=int, default=64, help="new tokens per completion")
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        theirs = hf_model(folder, args)
        cfg = model_config_from_hf(folder)
        ours = build_model(cfg, "cpu", seed=0)
        load_hf_weights(ours, folder)
    ours.eval()

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(1, args.vocab, (n,), generator=g).tolist() for n in lengths]
    longest = max(lengths)
    input_ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

    sampler = LocalSampler(ours, batch_size=args.batch)
    params = SamplingParams(args.new, temperature=0)

    def trainbook_side():
        return [c.ids for c in sampler.generate(prompts, [0] * args.batch, params)]

    @torch.no_grad()
    def hf_side():
        out = theirs.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=args.new,
                              min_new_tokens=args.new, do_sample=False, use_cache=True, pad_token_id=0)
        return out[:, longest:].tolist()

    times = {"trainbook": [], "transformers": []}
    results = {}
    trainbook_side(), hf_side()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("trainbook", trainbook_side), ("transformers", hf_side)):
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)

    tokens = args.batch * args.new
    best = {k: min(v) for k, v in times.items()}
    same = sum(a == b for a, b in zip(results["trainbook"], results["transformers"]))
    first_diff = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(results["trainbook"], results["transformers"])]
    print(f"model: Llama dim {args.dim}, {args.layers} layers, vocab {args.vocab}; batch {args.batch}, prompts "
          f"{min(lengths)}-{max(lengths)} tokens (left-padded), {args.new} new tokens each, greedy, "
          f"{args.threads} threads; torch {torch.__version__}, transformers {transformers.__version__}\n")
    print(f"{'side':<14}{'best s':>9}{'tokens/s':>11}   all runs (s)")
    for name in ("trainbook", "transformers"):
        runs = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:<14}{best[name]:>9.2f}{tokens / best[name]:>11,.0f}   {runs}")
    print(f"\nrollout tokens/s, trainbook / transformers generate: {best['transformers'] / best['trainbook']:.2f}x "
          "(target >= 1)")
    others = [d for d in first_diff if d < args.new]
    print(f"greedy completions equal token for token: {same}/{args.batch}"
          + (f"; the others agree for their first {min(others)} tokens at least" if others else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
