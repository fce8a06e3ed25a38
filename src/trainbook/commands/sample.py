"""Generate text from a run's checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from trainbook.checkpoint import load_state, locate
from trainbook.config import load_config
from trainbook.data import Tokenizer
from trainbook.model import build_model, generate
from trainbook.model.lora import apply_lora
from trainbook.runs import RunPaths


def sample(
    target: Path, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    run_dir, ckpt = locate(target)
    run = RunPaths.of(run_dir)
    cfg = load_config(run.config)
    tokenizer = Tokenizer.load(run.tokenizer)
    model = build_model(cfg.model, torch.device("cpu"), seed=cfg.run.seed)
    apply_lora(model, cfg.lora, seed=0)  # a LoRA run's checkpoint holds its adapters too
    state = {"model": model.state_dict()}
    load_state(ckpt, state)
    model.load_state_dict(state["model"])
    prompt_ids = tokenizer.encode(prompt)
    out = generate(
        model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
        eos_id=tokenizer.eos_id,
    )
    return prompt + tokenizer.decode(out)  # `generate` returns the new ids only
