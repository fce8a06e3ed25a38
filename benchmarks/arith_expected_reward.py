"""The exact expected held-out reward of arith runs at temperature 1, without sampling: for each
held-out addition, the probability the model gives its answer and EOS after the prompt (teacher
forcing), averaged. `trainbook eval --temperature 1` estimates the same quantity from samples
(exact_answer also accepts "085" for 85, which this leaves out), with a standard error of ~0.02 at
500 completions; this has none, so it can tell learning rates and batch sizes apart in a sweep
whose differences are smaller than a sampled eval's noise.

    .venv/bin/python benchmarks/arith_expected_reward.py RUN_OR_CHECKPOINT [...] [--data recipes/arith/heldout.jsonl]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trainbook.data import Tokenizer
from trainbook.data.prompts import PromptEncoder, read_prompts
from trainbook.runs import RunPaths
from trainbook.train.checkpoint_model import load_trained

HERE = Path(__file__).resolve().parent


@torch.no_grad()
def expected_reward(target: Path, data: Path) -> tuple[int, float]:
    """(the checkpoint's step, mean over `data`'s records of p(answer + EOS | prompt))."""
    trained = load_trained(target)
    tokenizer = Tokenizer.load(RunPaths.of(trained.run_dir).tokenizer)
    encoder = PromptEncoder.of_run(trained.cfg, tokenizer)
    model = trained.model.eval()
    total, records = 0.0, read_prompts(data)
    for r in records:
        prompt = encoder.ids(r.prompt, r.where)
        row = torch.tensor([prompt + tokenizer.encode(str(r.columns["answer"])) + [tokenizer.eos_id]])
        logp = torch.log_softmax(model(row[:, :-1]).float(), dim=-1)[0, len(prompt) - 1:]
        total += logp.gather(1, row[0, len(prompt):, None]).sum().exp().item()
    return trained.step, total / len(records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="+", type=Path, help="run directories or checkpoints")
    ap.add_argument("--data", type=Path, default=HERE.parent / "recipes" / "arith" / "heldout.jsonl")
    args = ap.parse_args()
    print(f"{'run or checkpoint':60} {'step':>5} {'expected reward':>15}")
    for target in args.targets:
        step, value = expected_reward(target, args.data)
        print(f"{str(target):60} {step:>5} {value:>15.4f}")


if __name__ == "__main__":
    main()
