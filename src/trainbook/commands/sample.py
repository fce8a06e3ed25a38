"""Generate text from a run's checkpoint."""

from __future__ import annotations

from pathlib import Path

from trainbook.data import Tokenizer
from trainbook.model import generate
from trainbook.runs import RunPaths
from trainbook.train.checkpoint_model import load_trained


def sample(
    target: Path, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    trained = load_trained(target)  # a LoRA run's checkpoint holds its adapters too
    tokenizer = Tokenizer.load(RunPaths.of(trained.run_dir).tokenizer)
    prompt_ids = tokenizer.encode(prompt)
    out = generate(
        trained.model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
        eos_id=tokenizer.eos_id,
    )
    return prompt + tokenizer.decode(out)  # `generate` returns the new ids only
