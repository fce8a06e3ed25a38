"""What tensor parallel asks of a model's attention: it shards heads, so the query heads and the
key/value heads both divide among the tp ranks (model/llama.py reshapes with -1 for this share).
Checked in the one resolution (an error) and by the OOM advice (a layout it does not suggest)."""

from __future__ import annotations

from trainbook.config import ModelConfig
from trainbook.errors import TrainbookError


def check_heads(model: ModelConfig, tp: int, where: str) -> None:
    """Raises a TrainbookError at `where`'s parallel.tp when a head count is not divisible by `tp`,
    or when the model is a mixture of experts or has latent attention and tp > 1 (their TP plans
    are not built yet)."""
    if model.n_experts is not None and tp > 1:
        raise TrainbookError(f"tensor parallel of a mixture of experts (model.n_experts = {model.n_experts}) is not "
                             f"built yet; use tp = 1", where=f"{where}: parallel.tp")
    if model.kv_lora_rank is not None and tp > 1:
        raise TrainbookError(f"tensor parallel of multi-head latent attention (model.kv_lora_rank = {model.kv_lora_rank}) "
                             "is not built yet; use tp = 1", where=f"{where}: parallel.tp")
    for heads in ("n_heads", "n_kv_heads"):
        if getattr(model, heads) % tp:
            raise TrainbookError(f"model.{heads} = {getattr(model, heads)} is not divisible by tp = {tp}",
                                 where=f"{where}: parallel.tp")
