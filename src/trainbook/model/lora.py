"""LoRA (Hu et al. 2021): low-rank adapters on a model's linear layers, the rest frozen.

A targeted `nn.Linear` becomes a `LoRALinear` that keeps the very same weight (and bias) tensors,
frozen, and adds two small matrices: y = W x + b + (alpha / r) * B A dropout(x), with
A (r, in) kaiming-uniform and B (out, r) zero, so the adapted model starts as the base model
exactly (bitwise: the base path is computed as before and a zero is added).

Names stay what they were, so checkpoints, Hugging Face export and per-layer statistics see the
base where they always did: `layers.0.attention.wq.weight` is still the base weight, and the
adapter adds `layers.0.attention.wq.lora_a.weight` (r, in) and `...wq.lora_b.weight` (out, r).
Every parameter outside the adapters is frozen: no gradient, no optimizer state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainbook.config.lora import ALL_LINEAR, LoraConfig
from trainbook.errors import TrainbookError
from trainbook.model.hf import to_hf_name

ADAPTER_PARTS = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """An `nn.Linear` (the base, frozen) plus a trainable low-rank update; still an `nn.Linear`
    to anything that looks for one, with the base's `weight` and `bias` under their names."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float,
                 generator: torch.Generator | None = None):
        nn.Module.__init__(self)  # not nn.Linear's: the base's tensors are kept, not reallocated
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Linear(self.in_features, rank, bias=False, **kw)  # A (r, in)
        self.lora_b = nn.Linear(rank, self.out_features, bias=False, **kw)  # B (out, r)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if base.weight.device.type != "meta":
            self.reset_adapter(generator)

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A as `nn.Linear` initialises its weight (and PEFT its lora_A): kaiming-uniform with
        a = sqrt(5), i.e. uniform(+-1/sqrt(in)); B zero, so the update B A starts at zero."""
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)  # exactly nn.Linear's computation
        # (..., in) -> (..., r) -> (..., out); dropout on the adapter's input only.
        return base + self.lora_b(self.lora_a(self.dropout(x))) * self.scale

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A, computed in fp32, in the base weight's dtype."""
        return merge(self.weight, self.lora_a.weight, self.lora_b.weight, self.scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W (out, in) + scale * B (out, r) @ A (r, in), in fp32, returned in W's dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def targeted(model: nn.Module, targets: list[str] | str) -> dict[str, nn.Linear]:
    """The linear layers inside the blocks (`layers.*`) that `targets` names, by module name; a
    one-line error for a target that names no module, or names one that is not linear. A mixture
    of experts' router gate is not one: the router multiplies by its weight itself, in fp32
    (model/moe.py), so an adapter on it would never run."""
    in_blocks = {name: m for name, m in model.named_modules() if name.startswith("layers.")}
    linear = {name: m for name, m in in_blocks.items()
              if isinstance(m, nn.Linear) and not _is_adapter_part(name) and not name.endswith(".router.gate")}
    if targets == ALL_LINEAR:
        return linear
    chosen: dict[str, nn.Linear] = {}
    for target in targets:
        named = [name for name in in_blocks if name == target or name.endswith("." + target)]
        if not named:
            leaves = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise TrainbookError(f"{target!r} names no module of the model (its linear layers: "
                                 f"{', '.join(leaves)}; or '{ALL_LINEAR}')", where="lora.targets")
        gates = [name for name in named if name.endswith(".router.gate")]
        if gates:
            raise TrainbookError(f"{target!r} names {gates[0]!r}, a mixture of experts' router gate, which LoRA does "
                                 "not adapt (the router multiplies by its weight itself, in fp32)", where="lora.targets")
        not_linear = [name for name in named if name not in linear]
        if not_linear:
            raise TrainbookError(f"{target!r} names {not_linear[0]!r} ({type(in_blocks[not_linear[0]]).__name__}), "
                                 "not a linear layer", where="lora.targets")
        chosen.update({name: linear[name] for name in named})
    return dict(sorted(chosen.items(), key=lambda kv: list(linear).index(kv[0])))


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int) -> list[str]:
    """Freeze `model` and put an adapter on each targeted linear layer (in module order, A drawn
    from a generator seeded with `seed`); returns notes for the run's warnings (none so far: the
    run prints what trains, `describe`). No-op at rank 0."""
    if not cfg.enabled:
        return []
    chosen = targeted(model, cfg.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for name, linear in chosen.items():
        parent_name, _, leaf = name.rpartition(".")
        lora = LoRALinear(linear, cfg.rank, cfg.alpha, cfg.dropout, generator=_on(generator, linear.weight))
        setattr(model.get_submodule(parent_name), leaf, lora)
    return []


def describe(model: nn.Module) -> str | None:
    """`LoRA rank 8, alpha 16 on 28 linear layers (w1, ..., wv)`, or None without adapters."""
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not adapted:
        return None
    first = next(iter(adapted.values()))
    leaves = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    return (f"LoRA rank {first.rank}, alpha {first.alpha:g} (scale {first.scale:g}) on {len(adapted)} "
            f"linear layers ({', '.join(leaves)})")


def _on(generator: torch.Generator, like: torch.Tensor) -> torch.Generator | None:
    """The CPU generator for CPU weights; on an accelerator, a generator of that device seeded
    from the CPU one (so the draw stays a function of the seed)."""
    if like.device.type in ("cpu", "meta"):
        return generator
    device_gen = torch.Generator(device=like.device)
    device_gen.manual_seed(int(torch.randint(2**62, (), generator=generator)))
    return device_gen


def _is_adapter_part(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_PARTS


def adapter_prefixes(state: dict[str, torch.Tensor]) -> list[str]:
    """The module names that carry an adapter in a state dict (`layers.0.attention.wq`, ...)."""
    return [k.removesuffix(".lora_a.weight") for k in state if k.endswith(".lora_a.weight")]


def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict with each adapter folded into its base weight (W + scale B A) and the adapter
    entries gone: the keys, shapes and dtypes of the base model's state dict."""
    out = {k: v for k, v in state.items() if not _is_adapter_key(k)}
    for prefix in adapter_prefixes(state):
        out[f"{prefix}.weight"] = merge(state[f"{prefix}.weight"], state[f"{prefix}.lora_a.weight"],
                                        state[f"{prefix}.lora_b.weight"], scale)
    return out


def _is_adapter_key(key: str) -> bool:
    return any(f".{part}." in key for part in ADAPTER_PARTS)


# PEFT's names (peft 0.21, `get_peft_model_state_dict`): the PeftModel wraps the transformers
# model as `base_model.model`, the adapter name ("default") is dropped on save, and the adapter
# of module M is `M.lora_A.weight` (r, in) / `M.lora_B.weight` (out, r).
PEFT_PREFIX = "base_model.model."
_PEFT_PART = {"lora_a": "lora_A", "lora_b": "lora_B"}


def to_peft_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a trainbook state dict under PEFT's names for the Hugging Face model:
    `layers.0.attention.wq.lora_a.weight` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    out = {}
    for prefix in adapter_prefixes(state):
        hf_module = hf_module_name(prefix)
        for part, peft_part in _PEFT_PART.items():
            out[f"{PEFT_PREFIX}{hf_module}.{peft_part}.weight"] = state[f"{prefix}.{part}.weight"]
    return out


def hf_module_name(module: str) -> str:
    """`layers.0.attention.wq` -> `model.layers.0.self_attn.q_proj` (through model/hf.py's table)."""
    return to_hf_name(f"{module}.weight").removesuffix(".weight")


def peft_target_modules(state: dict[str, torch.Tensor], n_layers: int) -> list[str]:
    """PEFT's `target_modules` for the adapters in `state`: a Hugging Face leaf name (`q_proj`)
    where every block has that adapter, else the full module names (PEFT matches either as a
    dotted suffix of a module's name)."""
    modules = [hf_module_name(p) for p in adapter_prefixes(state)]
    by_leaf: dict[str, list[str]] = {}
    for m in modules:
        by_leaf.setdefault(m.rsplit(".", 1)[-1], []).append(m)
    targets = []
    for leaf, ms in sorted(by_leaf.items()):
        targets += [leaf] if len(ms) == n_layers else sorted(ms)
    return targets
