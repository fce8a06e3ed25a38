"""The TRL side of benchmarks/sft_vs_trl.py, run by benchmarks/.venv-trl's python (TRL 1.16,
peft 0.21): it imports nothing of trainbook. Reads the spec the trainbook side wrote (model
folder, conversations, template, hyperparameters, the LoRA A matrices to start from) and
writes what TRL's SFTTrainer makes of it to OUT:

  labels.json     per conversation: input_ids and labels as SFTTrainer's collator gives them
  result.json     the loss of the first batch (before any step); epoch seconds (full, LoRA)
  grads.pt        the gradients of that loss (HF names), before any step
  full-LR.pt, lora-LR.pt  parameters after one optimizer step over the first batch at learning
                  rate LR, for each of the spec's step_lrs (HF / PEFT names)

Usage: .venv-trl/bin/python benchmarks/sft_vs_trl_trl.py SPEC.json OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import datasets
import peft
import safetensors.torch
import torch
import transformers
import trl


def _config(spec: dict, out: Path, steps: int | None, lr: float) -> trl.SFTConfig:
    kw = dict(
        output_dir=str(out / "trainer"), report_to="none", save_strategy="no", logging_steps=1,
        per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
        learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=spec["grad_clip"], optim="adamw_torch", seed=0, data_seed=0, bf16=False, fp16=False,
        use_cpu=True, gradient_checkpointing=False, dataloader_num_workers=0,
        assistant_only_loss=True, max_length=spec["seq_len"], packing=False, padding_free=False,
        dataset_num_proc=None, disable_tqdm=True,
    )
    if steps is not None:
        kw["max_steps"] = steps
    else:
        kw["num_train_epochs"] = 1
    return trl.SFTConfig(**kw)


def _tokenizer(spec: dict):
    tok = transformers.AutoTokenizer.from_pretrained(spec["model"])
    tok.chat_template = Path(spec["template"]).read_text()
    return tok


def _model(spec: dict):
    return transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)


def _lora(spec: dict) -> peft.LoraConfig:
    return peft.LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0, bias="none",
                           target_modules=spec["lora_targets"], task_type="CAUSAL_LM")


def _trainer(spec: dict, out: Path, records: list, steps: int | None, lora: bool,
             lr: float | None = None) -> trl.SFTTrainer:
    dataset = datasets.Dataset.from_list(records)
    config = _config(spec, out, steps, spec["lr"] if lr is None else lr)
    trainer = trl.SFTTrainer(model=_model(spec), args=config, train_dataset=dataset,
                             processing_class=_tokenizer(spec), peft_config=_lora(spec) if lora else None)
    if lora:  # start from trainbook's A (B is zero on both sides)
        start = safetensors.torch.load_file(spec["lora_a0"])
        result = peft.set_peft_model_state_dict(trainer.model, start)
        assert not result.unexpected_keys, result.unexpected_keys
    return trainer


class _Clock(transformers.TrainerCallback):
    """Seconds from the first step's start to the last step's end (model loading, dataset
    tokenization and the trainer's set-up left out, as on the trainbook side)."""

    def __init__(self):
        self.start = self.end = None

    def on_step_begin(self, args, state, control, **kw):
        if self.start is None:
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.end = time.perf_counter()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def main() -> int:
    spec_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    out.mkdir(parents=True, exist_ok=True)
    step_records = [json.loads(line) for line in Path(spec["step_data"]).read_text().splitlines()]
    epoch_records = [json.loads(line) for line in Path(spec["epoch_data"]).read_text().splitlines()]
    result = {"versions": {"torch": torch.__version__, "trl": trl.__version__, "peft": peft.__version__,
                           "transformers": transformers.__version__}}

    # Labels: every conversation of the epoch, through the trainer's own dataset and collator.
    trainer = _trainer(spec, out, epoch_records, 1, lora=False)
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    labels = []
    for row in rows:
        batch = trainer.data_collator([row])
        n = int(batch["attention_mask"][0].sum())
        labels.append({"input_ids": batch["input_ids"][0, :n].tolist(), "labels": batch["labels"][0, :n].tolist()})
    (out / "labels.json").write_text(json.dumps(labels))

    # The first batch's loss before any step (the step comparison's batch: the first `batch` rows).
    trainer = _trainer(spec, out, step_records, 1, lora=False)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    loss = trainer.model(**batch).loss  # the mean over the batch's labelled tokens
    loss.backward()
    result["loss"] = loss.item()
    result["batch_shape"] = list(batch["input_ids"].shape)
    torch.save({k: v.grad.clone() for k, v in trainer.model.named_parameters()}, out / "grads.pt")

    # One optimizer step over that batch, full and LoRA, at each learning rate.
    for lr in spec["step_lrs"]:
        for lora, name in ((False, "full"), (True, "lora")):
            trainer = _trainer(spec, out, step_records, 1, lora=lora, lr=lr)
            trainer.train()
            result[f"{name}_step_loss"] = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
            torch.save(_params(trainer.model), out / f"{name}-{lr:g}.pt")

    # An epoch of the larger set, timed, full and LoRA.
    for lora, name in ((False, "full"), (True, "lora")):
        trainer = _trainer(spec, out, epoch_records, None, lora=lora)
        clock = _Clock()
        trainer.add_callback(clock)
        trainer.train()
        result[f"{name}_epoch_s"] = clock.end - clock.start
        result[f"{name}_epoch_steps"] = trainer.state.global_step
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
