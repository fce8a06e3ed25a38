"""The TRL side of benchmarks/grpo_vs_trl.py, run by benchmarks/.venv-trl's python (TRL 1.16): it
imports nothing of trainbook. Reads the spec the trainbook side wrote (model folder, prompts, the
fixed completions of each prompt, the cases) and, for each case, trains TRL's GRPOTrainer for
`updates` steps on one rollout whose completions are the spec's (TRL's `rollout_func`), scored by
benchmarks/grpo_reward.py. Writes to OUT:

  CASE.json     the prompt ids TRL encoded, each completion's advantage (keyed by prompt and
                completion index) and each step's loss
  CASE.pt       every parameter after the steps
  speed.json    with the spec's `speed`: instead, each second of `steps` GRPO steps with TRL's own
                generation on the spec's prompts

Usage: .venv-trl/bin/python benchmarks/grpo_vs_trl_trl.py SPEC.json OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import datasets
import torch
import transformers
import trl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_reward import digits  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def run_case(spec: dict, case: dict, out: Path) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(spec["model"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    completions = spec["completions"]  # prompt -> its G completions' ids
    served: dict[str, int] = {}
    seen = {"prompt_ids": {}, "advantages": {}}

    def rollout(prompts, trainer):
        prompt_ids, completion_ids = [], []
        for p in prompts:
            j = served.get(p, 0)
            served[p] = j + 1
            prompt_ids.append(tok(p, add_special_tokens=False)["input_ids"])
            completion_ids.append(completions[p][j % len(completions[p])])
            seen["prompt_ids"][p] = prompt_ids[-1]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    config = trl.GRPOConfig(
        output_dir=str(out / "trainer"), report_to="none", save_strategy="no", logging_steps=1,
        per_device_train_batch_size=len(completions) * spec["group_size"], gradient_accumulation_steps=1,
        num_generations=spec["group_size"], max_completion_length=spec["max_new_tokens"],
        num_iterations=case["updates"], max_steps=case["updates"], beta=case["kl_coef"], loss_type=case["loss_agg"],
        epsilon=spec["clip_low"], epsilon_high=spec["clip_high"], scale_rewards="group", temperature=1.0,
        learning_rate=case["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=spec["grad_clip"], optim="adamw_torch", seed=0,
        data_seed=0, bf16=False, fp16=False, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        log_completions=False,
        # trainbook's KL term is the GRPO paper's k3; TRL 1.16 by default multiplies it by the
        # importance ratio (DeepSeek-V3.2's unbiased estimate), which moves a second update's gradient.
        use_bias_correction_kl=False,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[digits], args=config, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in completions]),
                              rollout_func=rollout)
    score = trainer._generate_and_score_completions

    def recorded(inputs):
        output = score(inputs)
        count: dict[str, int] = {}
        for p, a in zip([x["prompt"] for x in inputs], output["advantages"].tolist()):
            j = count.get(p, 0)
            count[p] = j + 1
            seen["advantages"][f"{p}|{j}"] = a
        return output

    trainer._generate_and_score_completions = recorded
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    torch.save({k: v.detach().clone() for k, v in trainer.model.named_parameters()}, out / f"{case['name']}.pt")
    return {**seen, "losses": losses}


class _Clock(transformers.TrainerCallback):
    """Each step's seconds, from its start to its end (generation, scoring, forward, backward)."""

    def __init__(self):
        self.steps: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kw):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.steps.append(time.perf_counter() - self._start)


def speed(spec: dict, out: Path) -> dict:
    """`steps` GRPO steps with TRL's own generation (transformers' generate, its KV cache) on the
    spec's prompts: each step's seconds."""
    s = spec["speed"]
    tok = transformers.AutoTokenizer.from_pretrained(spec["model"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    config = trl.GRPOConfig(
        output_dir=str(out / "trainer"), report_to="none", save_strategy="no", logging_steps=1,
        per_device_train_batch_size=s["prompts_per_step"] * spec["group_size"], gradient_accumulation_steps=1,
        num_generations=spec["group_size"], max_completion_length=s["max_new_tokens"], max_steps=s["steps"],
        beta=0.0, loss_type="dapo", temperature=1.0, top_p=1.0, learning_rate=1e-6, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=spec["grad_clip"], optim="adamw_torch", seed=0, data_seed=0,
        bf16=False, fp16=False, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[digits], args=config, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in s["prompts"]]))
    clock = _Clock()
    trainer.add_callback(clock)
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_s": clock.steps, "mean_length": lengths}


def main() -> int:
    spec_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    out.mkdir(parents=True, exist_ok=True)
    versions = {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__}
    (out / "versions.json").write_text(json.dumps(versions))
    if "speed" in spec:
        (out / "speed.json").write_text(json.dumps(speed(spec, out)))
        return 0
    for case in spec["cases"]:
        (out / f"{case['name']}.json").write_text(json.dumps(run_case(spec, case, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
