"""GRPO side by side with TRL's GRPOTrainer (issue 29), fed identical completions: the same tiny
random Hugging Face Llama and byte tokenizer (benchmarks/dpo_vs_trl.py's), two prompts, and for
each a fixed group of completions (random digits and letters, some ending in EOS), given to TRL
through its `rollout_func` and to trainbook through its rollout-engine seam (model/sampler.py's
`RolloutEngine`: an engine that returns them instead of sampling). Both score them with
benchmarks/grpo_reward.py. For each `loss_agg` x `kl_coef` in {0, 0.04} x `updates_per_rollout` in
{1, 2} (TRL's `loss_type`, `beta`, `num_iterations`), through trainbook's own trainer (the recipe's
[grpo], its optimizer and clipping) and TRL's:

  advantages  every completion's advantage, max |difference|
  loss        each step's loss, max |difference|
  params      every parameter after the steps, max |difference| and how many weights differ by
              more than 1e-6 (fp32 AdamW, clip 1.0, betas 0.9/0.999)

TRL with `use_bias_correction_kl = False` (its 1.16 default, True, multiplies the KL term by the
importance ratio; trainbook's `kl_estimator = "k3"` is the GRPO paper's term without it: with it
TRL's second-update losses differ by ~1e-4 at lr 1e-3 and kl 0.04), at TRL's GRPO default lr 1e-6, and at 1e-3, where the second update of a rollout has a ratio away
from 1 and a KL away from 0 to compare (and Adam's first step, lr * g / (|g| + eps), turns the
last bits of a tiny gradient into a visible fraction of lr, as benchmarks/sft_vs_trl.py shows).

The TRL side runs in its own venv (benchmarks/sft_vs_trl_venv.sh makes benchmarks/.venv-trl) as a
subprocess (benchmarks/grpo_vs_trl_trl.py).

    bash benchmarks/sft_vs_trl_venv.sh          # once
    .venv/bin/python benchmarks/grpo_vs_trl.py  # ~2 min on 2 CPU cores

and then a whole GRPO step side by side, each with its own generation (`--speed-only` for that
alone): TRL's GRPOTrainer with transformers' generate against trainbook's trainer and sampler on
the same prompts, group size and completion length, seconds a step and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dpo_vs_trl import write_models
from trl_side import adamw_tail, max_diff, need_trl_venv, recipe_head, run_trl, trainer_of
from trainbook.model.hf import to_hf_state_dict
from trainbook.model.sampler import Completion

HERE = Path(__file__).resolve().parent
EOS = 0  # the byte tokenizer's <|endoftext|>
DIGITS = list(range(1 + ord("0"), 1 + ord("9") + 1))  # byte b is id 1 + b
LETTERS = list(range(1 + ord("a"), 1 + ord("z") + 1))
LRS = (1e-6, 1e-3)  # TRL's GRPO default, and one large enough that a second update sees the KL and the clip
CASES = [{"name": f"{agg}-kl{kl:g}-u{u}-lr{lr:g}", "loss_agg": agg, "kl_coef": kl, "updates": u, "lr": lr}
         for lr in LRS for agg in ("dapo", "grpo", "dr_grpo") for kl in (0.0, 0.04) for u in (1, 2)]


def fixed_completions(prompts: list[str], group: int, max_new: int, seed: int) -> dict[str, list[list[int]]]:
    """Each prompt's group: completions of 1 to max_new ids, digits and letters mixed, ending in
    EOS (which counts within max_new) with probability 0.6."""
    rng = np.random.default_rng(seed)
    out = {}
    for p in prompts:
        rows = []
        for _ in range(group):
            stops = rng.random() < 0.6
            n = int(rng.integers(1, max_new + (0 if stops else 1)))
            rows.append([int(rng.choice(DIGITS if rng.random() < 0.5 else LETTERS)) for _ in range(n)]
                        + ([EOS] if stops else []))
        out[p] = rows
    return out


class FixedEngine:
    """A rollout engine (model/sampler.py's protocol) that serves each prompt's fixed completions
    in order, whatever the seeds: what a colocated inference engine would plug in the same way."""

    def __init__(self, completions: dict[str, list[list[int]]], encode):
        self.by_ids = {tuple(encode(p)): rows for p, rows in completions.items()}
        self.served: dict[tuple, int] = {}

    def generate(self, prompts, seeds, params, progress=None) -> list[Completion]:
        out = []
        for ids in prompts:
            key = tuple(ids)
            j = self.served.get(key, 0)
            self.served[key] = j + 1
            row = self.by_ids[key][j % len(self.by_ids[key])]
            out.append(Completion(list(row), bool(row) and row[-1] == EOS))
        return out


def write_recipe(work: Path, args, case: dict) -> Path:
    recipe = work / f"{case['name']}.toml"
    recipe.write_text(f"""
{recipe_head(work, 'grpo', args)}

[[data.sources]]
name = "prompts"
paths = ["{work / 'prompts.jsonl'}"]
format = "prompts"

[data]
cache_dir = "{work / 'cache'}"
val_fraction = 0.0

[grpo]
group_size = {args.group}
prompts_per_step = {len(args.prompts)}
max_new_tokens = {args.max_new}
temperature = 1.0
clip_low = {args.clip_low}
clip_high = {args.clip_high}
loss_agg = "{case['loss_agg']}"
kl_coef = {case['kl_coef']}
updates_per_rollout = {case['updates']}

[[grpo.reward]]
function = "grpo_reward:digits"

[train]
seq_len = 32
micro_batch_size = {len(args.prompts) * args.group}
max_steps = {case['updates']}
eval_every = 0
compile = false

{adamw_tail(case['lr'], args.grad_clip)}
""")
    return recipe


def ours(work: Path, args, case: dict, completions: dict) -> dict:
    with trainer_of(write_recipe(work, args, case), work, case["name"]) as (trainer, data, cfg):
        objective = trainer.step.objective
        objective.engine = FixedEngine(completions, data.tokenizer.encode)
        losses = [trainer.advance().loss for _ in range(case["updates"])]
        last = objective.last
        count: dict[str, int] = {}
        advantages = {}
        for p, a in zip(last["prompts"], last["advantages"]):
            j = count.get(p, 0)
            count[p] = j + 1
            advantages[f"{p}|{j}"] = a
        params = to_hf_state_dict({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, tied=False)
        prompt_ids = {p: data.tokenizer.encode(p) for p in completions}
    return {"advantages": advantages, "losses": losses, "params": params, "prompt_ids": prompt_ids}


def speed(args) -> None:
    """Whole GRPO steps on the same work, each side with its own generation: TRL's GRPOTrainer
    (transformers' generate with its KV cache) and trainbook's trainer (model/sampler.py); the
    median seconds of the steps after the first, and their ratio."""
    rng = np.random.default_rng(1)
    prompts = [f"Q: {a}+{b}\nA: " for a, b in rng.integers(0, 100, (args.speed_prompts * args.speed_steps, 2))]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_models(work, args.speed_dim, args.speed_layers)
        (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        spec = {"model": str(work / "model"), "group_size": args.group, "grad_clip": args.grad_clip,
                "threads": args.threads, "speed": {"prompts": prompts, "prompts_per_step": args.speed_prompts,
                                                   "max_new_tokens": args.speed_new, "steps": args.speed_steps}}
        (work / "spec.json").write_text(json.dumps(spec))
        run_trl("grpo_vs_trl_trl.py", work / "spec.json", work / "trl")
        theirs = json.loads((work / "trl" / "speed.json").read_text())
        case = {"name": "speed", "loss_agg": "dapo", "kl_coef": 0.0, "updates": args.speed_steps, "lr": 1e-6}
        recipe = write_recipe(work, args, case)
        text = recipe.read_text()
        for key, value in (("prompts_per_step", args.speed_prompts), ("max_new_tokens", args.speed_new),
                           ("updates_per_rollout", 1), ("micro_batch_size", args.speed_prompts * args.group),
                           ("seq_len", 64)):
            text = "\n".join(f"{key} = {value}" if line.startswith(f"{key} = ") else line for line in text.splitlines())
        recipe.write_text(text + "\n")
        steps, lengths = [], []
        with trainer_of(recipe, work, "speed") as (trainer, data, cfg):
            for _ in range(args.speed_steps):
                start = time.perf_counter()
                trainer.advance()
                steps.append(time.perf_counter() - start)
                lengths.append(trainer.step.objective._rollout_figures["completions/mean_length"])
    ours_s, trl_s = statistics.median(steps[1:]), statistics.median(theirs["step_s"][1:])
    print(f"\nA whole GRPO step, each side with its own generation: {args.speed_prompts} prompts x {args.group} "
          f"completions of up to {args.speed_new} tokens, a {args.speed_dim}-dim {args.speed_layers}-layer Llama, "
          f"{args.threads} threads, median of steps 2..{args.speed_steps}\n")
    print(f"trainbook  {ours_s:.3f} s a step  (mean completion length {statistics.mean(lengths):.1f})")
    print(f"TRL        {trl_s:.3f} s a step  (mean completion length {statistics.mean(theirs['mean_length']):.1f})")
    print(f"ratio      {trl_s / ours_s:.2f}x (TRL's time over trainbook's)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=6)
    ap.add_argument("--clip-low", type=float, default=0.2)
    ap.add_argument("--clip-high", type=float, default=0.28)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speed-only", action="store_true", help="only the step-time comparison")
    ap.add_argument("--speed-prompts", type=int, default=4)
    ap.add_argument("--speed-new", type=int, default=32)
    ap.add_argument("--speed-steps", type=int, default=6)
    ap.add_argument("--speed-dim", type=int, default=256)
    ap.add_argument("--speed-layers", type=int, default=4)
    args = ap.parse_args()
    args.prompts = ["Q: 12+34\nA: ", "Q: 7+58\nA: "]
    need_trl_venv()
    torch.set_num_threads(args.threads)
    if args.speed_only:
        speed(args)
        return 0
    completions = fixed_completions(args.prompts, args.group, args.max_new, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_models(work, args.dim, args.layers)
        (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in args.prompts))
        spec = {"model": str(work / "model"), "completions": completions, "group_size": args.group,
                "max_new_tokens": args.max_new, "clip_low": args.clip_low, "clip_high": args.clip_high,
                "grad_clip": args.grad_clip, "threads": args.threads, "cases": CASES}
        (work / "spec.json").write_text(json.dumps(spec))
        run_trl("grpo_vs_trl_trl.py", work / "spec.json", work / "trl")
        versions = json.loads((work / "trl" / "versions.json").read_text())
        for case in CASES:
            theirs = json.loads((work / "trl" / f"{case['name']}.json").read_text())
            mine = ours(work, args, case, completions)
            assert mine["prompt_ids"] == theirs["prompt_ids"], "the prompts' ids differ"
            assert sorted(mine["advantages"]) == sorted(theirs["advantages"])
            adv = max(abs(mine["advantages"][k] - theirs["advantages"][k]) for k in mine["advantages"])
            loss = max(abs(a - b) for a, b in zip(mine["losses"], theirs["losses"]))
            after = torch.load(work / "trl" / f"{case['name']}.pt")
            worst, where, _ = max_diff(mine["params"], after)
            over = sum(int(((mine["params"][k] - after[k]).abs() > 1e-6).sum()) for k in mine["params"])
            total = sum(v.numel() for v in mine["params"].values())
            rows.append((case["name"], f"{adv:.1e}", f"{loss:.1e}", " ".join(f"{x:+.5f}" for x in mine["losses"]),
                         f"{worst:.1e}", f"{over} of {total:,}"))
    print(f"GRPO side by side, identical completions: trainbook vs TRL {versions['trl']} (transformers "
          f"{versions['transformers']}, torch {versions['torch']}); {len(args.prompts)} prompts x {args.group} "
          f"completions of at most {args.max_new} tokens, clip [{1 - args.clip_low:g}, {1 + args.clip_high:g}], "
          f"a {args.dim}-dim {args.layers}-layer Llama, CPU fp32\n")
    head = ("case (loss_agg-kl-updates-lr)", "adv |diff|", "loss |diff|", "trainbook losses", "params |diff|",
            "weights > 1e-6")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    speed(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
