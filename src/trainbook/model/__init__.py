"""Model definitions and the registry of named sizes. Knows nothing of parallelism, losses,
optimizers or logging: the trainer computes the loss from `Llama.forward`'s logits, and
`parallel/` applies itself from outside by module path."""

from trainbook.model.generate import generate
from trainbook.model.count import ModelCount, count, flops_per_token, num_params
from trainbook.model.llama import Llama, build_model
from trainbook.model.registry import names, resolve

__all__ = ["Llama", "ModelCount", "build_model", "count", "flops_per_token", "generate", "names", "num_params", "resolve"]
