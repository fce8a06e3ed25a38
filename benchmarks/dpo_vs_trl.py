"""DPO side by side with TRL's DPOTrainer (issue 29): the same tiny random Hugging Face Llama, the
arithmetic recipe's byte tokenizer (no merges, so a prompt's tokens are a prefix of the prompt +
completion's on both sides) and string preference pairs on both sides.

  tokens      every pair's ids and completion mask: trainbook's (train/dpo.py: dpo_inputs) against
              DPOTrainer's dataset and collator, integer equality
  loss        the DPO loss and TRL's metrics (rewards/chosen, rejected, margins, accuracies,
              logps/chosen, rejected) of the whole set as one batch: against the policy itself
              as reference (the loss is ln 2) and against a second, perturbed model
  step        every parameter after one AdamW step over that batch (fp32, constant lr, no
              warmup, no weight decay, clip 1.0, betas 0.9/0.999; the reference the starting
              policy), at each of --step-lrs: TRL's DPO default 1e-6, and 1e-3, where Adam's first
              step, lr * g / (|g| + eps), turns the last bits of a tiny gradient (summed in another
              order on each side) into a visible fraction of lr

The TRL side runs in its own venv (benchmarks/sft_vs_trl_venv.sh makes benchmarks/.venv-trl) as a
subprocess (benchmarks/dpo_vs_trl_trl.py).

    bash benchmarks/sft_vs_trl_venv.sh          # once
    .venv/bin/python benchmarks/dpo_vs_trl.py   # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from trl_side import adamw_tail, max_diff, need_trl_venv, recipe_head, run_trl, trainer_of
from trainbook.commands.preflight import prepare_data
from trainbook.commands.resolve import resolve
from trainbook.model.hf import to_hf_state_dict
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.runtime import Runtime
from trainbook.train.build import full_model
from trainbook.train.dpo import DpoObjective, dpo_inputs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TOKENIZER = REPO / "recipes" / "arith" / "tokenizer.json"
EOS = "<|endoftext|>"
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def pairs(n: int, seed: int) -> list[dict]:
    """Additions as string pairs: the right sum chosen, one off by 1 or 10 rejected."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        wrong = a + b + int(rng.choice([d for d in (-10, -1, 1, 10) if a + b + d >= 0]))
        out.append({"prompt": f"Q: {a}+{b}\nA: ", "chosen": str(a + b), "rejected": str(wrong)})
    return out


def write_models(work: Path, dim: int, layers: int) -> None:
    """`model/`: a tiny random LlamaForCausalLM with the byte tokenizer; `reference/`: the same
    with every weight moved by N(0, 0.02) noise."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token=EOS, pad_token=EOS)
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for folder in ("model", "reference"):
        tok.save_pretrained(work / folder)
    model.save_pretrained(work / "model")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(work / "reference")


def write_recipe(work: Path, args, lr: float) -> Path:
    recipe = work / f"dpo-{lr:g}.toml"
    recipe.write_text(f"""
{recipe_head(work, 'dpo', args)}

[[data.sources]]
name = "pairs"
paths = ["{work / 'pairs.jsonl'}"]
format = "preference"

[data]
cache_dir = "{work / 'cache'}"
val_fraction = 0.0

[data.dedup]
exact = false

[dpo]
beta = {args.beta}
pairs_per_step = {args.pairs}
reference = "frozen"

[train]
seq_len = 32
micro_batch_size = {args.pairs}
max_steps = 1
eval_every = 0
compile = false

{adamw_tail(lr, args.grad_clip)}
""")
    return recipe


def ours_tokens(recipe: Path) -> list[dict]:
    res = resolve(recipe, [], world_size=1)
    data = prepare_data(res, log=lambda *a, **k: None)
    out = []
    for p in dpo_inputs(res.cfg, data.tokenizer):
        out.append({side: getattr(p, side).ids for side in ("chosen", "rejected")}
                   | {f"{side}_mask": [0, *map(int, getattr(p, side).trained)] for side in ("chosen", "rejected")})
    return out


def ours_loss(recipe: Path, work: Path, reference: str | None, args) -> dict:
    """The loss and figures of the whole set as one batch, the reference the policy or a folder."""
    res = resolve(recipe, [], world_size=1)
    cfg = res.cfg
    data = prepare_data(res, log=lambda *a, **k: None)
    policy = full_model(cfg, torch.device("cpu"))
    ref_cfg = cfg if reference is None else cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"init_from": f"hf:{reference}"})})
    ref = full_model(ref_cfg, torch.device("cpu")).eval()
    rt = Runtime(0, 1, ParallelDims(1, 1, 1, 1), torch.device("cpu"))
    obj = DpoObjective(cfg.dpo, dpo_inputs(cfg, data.tokenizer), rt, micro_batch_size=args.pairs,
                       pad_id=data.tokenizer.eos_id, seed=0, policy=policy, reference=ref)
    with torch.no_grad():
        part = obj.loss(policy, next(obj.produce(iter(()))))
    return {"loss": obj.finish(part.value, 1).item(), **obj.figures()}


def ours_step(recipe: Path, work: Path) -> dict[str, torch.Tensor]:
    with trainer_of(recipe, work, recipe.stem) as (trainer, data, cfg):
        trainer.advance()
        return to_hf_state_dict({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, tied=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--step-lrs", default="1e-6,1e-3", help="TRL's DPO default, and a large one")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    need_trl_venv()
    lrs = [float(x) for x in args.step_lrs.split(",")]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_models(work, args.dim, args.layers)
        data = pairs(args.pairs, seed=0)
        (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in data))
        spec = {"model": str(work / "model"), "reference": str(work / "reference"), "pairs": data,
                "beta": args.beta, "grad_clip": args.grad_clip, "step_lrs": lrs, "threads": args.threads}
        (work / "spec.json").write_text(json.dumps(spec))
        run_trl("dpo_vs_trl_trl.py", work / "spec.json", work / "trl")
        theirs = json.loads((work / "trl" / "result.json").read_text())
        rows = []

        ours_ids = ours_tokens(write_recipe(work, args, lrs[0]))
        their_ids = json.loads((work / "trl" / "tokens.json").read_text())
        same = sum(o == t for o, t in zip(ours_ids, their_ids))
        rows.append(("ids and completion masks of every pair (both sides)", f"{same}/{len(data)} equal", ""))

        for name, ref in (("self", None), ("other", work / "reference")):
            ours = ours_loss(write_recipe(work, args, lrs[0]), work, ref, args)
            what = "reference = policy" if ref is None else "reference = perturbed model"
            rows.append((f"{what}: loss", f"{ours['loss']:.7f}", f"{theirs[name]['loss']:.7f}"))
            for k in FIGURES:
                rows.append((f"{what}: {k}", f"{ours[k]:.7f}", f"{theirs[name][k]:.7f}"))
        rows.append(("ln 2", f"{math.log(2):.7f}", ""))

        for lr in lrs:
            after = ours_step(write_recipe(work, args, lr), work)
            theirs_after = torch.load(work / "trl" / f"after-{lr:g}.pt")
            worst, where, n = max_diff(after, theirs_after)
            over = sum(int(((after[k] - theirs_after[k]).abs() > 1e-6).sum()) for k in after)
            total = sum(v.numel() for v in after.values())
            rows.append((f"lr {lr:g}: params after 1 step, max |diff| ({n} tensors)", f"{worst:.2e}", where))
            rows.append((f"lr {lr:g}: weights differing by more than 1e-6", f"{over:,} of {total:,}", ""))

    print(f"DPO side by side: trainbook vs TRL {theirs['versions']['trl']} (transformers "
          f"{theirs['versions']['transformers']}, torch {theirs['versions']['torch']}), {args.pairs} pairs, "
          f"beta {args.beta}, a {args.dim}-dim {args.layers}-layer Llama, CPU fp32\n")
    width = max(len(r[0]) for r in rows)
    print(f"{'quantity'.ljust(width)}  {'trainbook':>16}  TRL")
    for name, a, b in rows:
        print(f"{name.ljust(width)}  {a:>16}  {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
