"""The TRL side of benchmarks/dpo_vs_trl.py, run by benchmarks/.venv-trl's python (TRL 1.16): it
imports nothing of trainbook. Reads the spec the trainbook side wrote (the policy and reference
folders, the pairs, hyperparameters) and writes what TRL's DPOTrainer makes of it to OUT:

  tokens.json   per pair (in file order): prompt + chosen and prompt + rejected ids, and the
                completion mask of each, as DPOTrainer's dataset and collator give them
  result.json   the loss and TRL's metrics of the whole set as one batch, against the policy
                itself as reference and against the other reference folder
  after-LR.pt   every parameter after one AdamW step over that batch at learning rate LR (the
                policy itself as reference, TRL's default), for each of the spec's step_lrs

Usage: .venv-trl/bin/python benchmarks/dpo_vs_trl_trl.py SPEC.json OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch
import transformers
import trl


def _trainer(spec: dict, out: Path, lr: float, ref: str | None) -> trl.DPOTrainer:
    config = trl.DPOConfig(
        output_dir=str(out / "trainer"), report_to="none", save_strategy="no", logging_steps=1,
        per_device_train_batch_size=len(spec["pairs"]), gradient_accumulation_steps=1, max_steps=1,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=spec["grad_clip"], optim="adamw_torch", seed=0,
        data_seed=0, bf16=False, fp16=False, use_cpu=True, dataloader_num_workers=0, beta=spec["beta"],
        loss_type=["sigmoid"], max_length=None, dataset_num_proc=None, disable_tqdm=True,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    ref_model = None if ref is None else transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(spec["model"])
    return trl.DPOTrainer(model=model, ref_model=ref_model, args=config,
                          train_dataset=datasets.Dataset.from_list(spec["pairs"]), processing_class=tok)


def _whole_batch(trainer: trl.DPOTrainer) -> dict:
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    return trainer.data_collator(rows)


def main() -> int:
    spec_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    out.mkdir(parents=True, exist_ok=True)
    result = {"versions": {"torch": torch.__version__, "trl": trl.__version__,
                           "transformers": transformers.__version__}}

    trainer = _trainer(spec, out, 1e-3, None)
    batch = _whole_batch(trainer)
    n = len(spec["pairs"])
    tokens = []
    for i in range(n):
        row = {}
        for side, j in (("chosen", i), ("rejected", n + i)):
            length = int(batch["attention_mask"][j].sum())  # right padding
            row[side] = batch["input_ids"][j, :length].tolist()
            row[f"{side}_mask"] = batch["completion_mask"][j, :length].tolist()
        tokens.append(row)
    (out / "tokens.json").write_text(json.dumps(tokens))

    for name, ref in (("self", None), ("other", spec["reference"])):
        trainer = _trainer(spec, out, 1e-3, ref)
        trainer.model.train()  # as in training: TRL files the step's metrics under "train"
        trainer._metrics["train"].clear()
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, _whole_batch(trainer))
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        result[name] = {"loss": loss.item(), **metrics}

    for lr in spec["step_lrs"]:
        trainer = _trainer(spec, out, lr, None)
        trainer.train()
        result[f"step_loss_{lr:g}"] = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
        torch.save({k: v.detach().clone() for k, v in trainer.model.named_parameters()}, out / f"after-{lr:g}.pt")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
