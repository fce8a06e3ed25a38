"""Precision policy: the dtype forward and backward run in, the ops that stay fp32, loss scaling.

Every policy keeps master weights and optimizer state in fp32; only the compute is lowered:
- without FSDP, forward runs under `torch.autocast(device_type, dtype)`: matmuls in the compute
  dtype, everything autocast does not list (and every op in FP32_OPS) in fp32;
- with FSDP2, its `MixedPrecisionPolicy` casts the gathered parameters to the compute dtype and
  reduce-scatters gradients in fp32; autocast is then off (as in torchtitan), so the model's own
  casts (FP32_OPS) are what keep the sensitive ops in fp32.
fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is scaled up first,
and a scale too large overflows. `LossScaler` finds the largest scale that does not overflow.
bf16 has fp32's exponent range and needs no scaling; fp32 and bf16 get a disabled scaler, so the
step needs no branches.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainbook.config import PrecisionConfig

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Fp32Op(NamedTuple):
    where: str
    """The code that keeps it in fp32."""
    why: str


# The ops that compute in fp32 whatever the compute dtype: the one list, checked entry by entry
# on the model by tests/unit/train/test_precision.py (it fails if an entry has no check).
FP32_OPS: dict[str, Fp32Op] = {
    # mean(x^2) over `dim` channels: a bf16 accumulator (8 significant bits) stops growing once
    # it is ~256x any one term, and rsqrt of it sets the scale of every output.
    "rmsnorm_statistics": Fp32Op(
        "model/llama.py RMSNorm.forward: x.float() before pow, mean and rsqrt; the result is cast back",
        "a low-precision mean of squares is biased and sets every activation's scale"),
    # exp() overflows fp16 above 11.1, and a T-long running sum of probabilities or of P @ V
    # loses the small terms in bf16. The fused kernels (CPU flash, CUDA flash/efficient/cuDNN)
    # keep the running max, the softmax sum and the output accumulator in fp32 for bf16/fp16
    # inputs, so q, k, v stay in the compute dtype: the test measures the kernel's error at
    # ~1.3x the output's own rounding, against 9-17x for running sums in the compute dtype.
    "attention_softmax": Fp32Op(
        "model/llama.py Attention.forward: F.scaled_dot_product_attention (fp32 accumulation inside)",
        "softmax overflows fp16 and loses small probabilities in bf16"),
    # Angles position * theta^(-2i/d) reach max_seq_len radians: in bf16 an angle near 1000 is
    # off by up to 2 radians (its spacing there is 4), so nearby positions become one.
    "rope": Fp32Op(
        "model/llama.py rope_tables (fp32 buffers, which FSDP does not cast; the blocks get them as "
        "inputs, which parallel/apply.py apply_fsdp leaves uncast) and apply_rope (x.float() before "
        "the rotation; the result is cast back)",
        "angles at long positions lose whole rotations in bf16/fp16"),
    # log-softmax over the vocabulary: a 128K-term log-sum-exp, and the loss is what gets scaled.
    "loss": Fp32Op(
        "train/step.py lm_loss: logits.float() before cross_entropy (log-softmax + NLL)",
        "a vocabulary-wide log-sum-exp in low precision biases the loss and its gradient"),
}


class Precision:
    """The policy of one run: `autocast()` around forward (and loss), `fsdp_policy()` for
    `fully_shard`, `loss_scaler()` for the step. `fsdp`: the model is FSDP2-sharded, whose
    policy then does the casting and autocast stays off."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device | str, *, fsdp: bool = False):
        self.cfg = cfg
        self.name = cfg.dtype
        self.dtype = COMPUTE_DTYPES[cfg.dtype]
        self.device = torch.device(device)
        self.fsdp = fsdp

    def autocast(self) -> contextlib.AbstractContextManager:
        """Matmuls in the compute dtype, the rest (FP32_OPS included) in fp32. Off for fp32, and
        under FSDP, whose policy has cast the parameters already."""
        if self.dtype == torch.float32 or self.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def fsdp_policy(self, reduce: str = "fp32"):
        return fsdp_policy(self.name, reduce)

    def loss_scaler(self) -> LossScaler:
        """Dynamic loss scaling for fp16 (settings from `[precision]`); a disabled one otherwise."""
        if self.name != "fp16":
            return LossScaler(enabled=False, device=self.device)
        c = self.cfg
        return LossScaler(
            init_scale=c.loss_scale_init, growth_factor=c.loss_scale_growth,
            growth_interval=c.loss_scale_interval, backoff_factor=c.loss_scale_backoff,
            min_scale=c.loss_scale_min, device=self.device,
        )


def fsdp_policy(dtype: str, reduce: str = "fp32"):
    """FSDP2 mixed precision for compute dtype `dtype` (`fp32|bf16|fp16`): parameters gathered in
    it, gradients reduced in `reduce` (parallel.reduce_dtype; fp32 by default) and kept fp32 in the
    sharded master copy; fp32 with fp32 reduction: no casts."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param, grads = COMPUTE_DTYPES[dtype], COMPUTE_DTYPES[reduce]
    if param == torch.float32 and grads == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=None if param == torch.float32 else param, reduce_dtype=grads)


def hold_frozen_projections(model: torch.nn.Module, dtype: str) -> int:
    """Keep every frozen projection weight (an `nn.Linear`'s, LoRA's base among them) in the
    compute dtype `dtype` instead of fp32; returns how many. Nothing else changes: autocast and
    FSDP's policy cast such a weight to the compute dtype for every matmul anyway (the same
    round-to-nearest), so storing the cast once computes the same bits, while the weight takes
    half the memory and autocast makes no copy of it. A frozen weight has no master copy to keep
    precise. Trainable weights, norms and embedding tables (and a head tied to one: the lookup
    is not autocast) stay fp32. fp32: nothing to do."""
    lowered = COMPUTE_DTYPES[dtype]
    if lowered == torch.float32:
        return 0
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    count = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if (isinstance(module, torch.nn.Linear) and w is not None and not w.requires_grad
                and id(w) not in tables and w.dtype == torch.float32):
            w.data = w.data.to(lowered)
            count += 1
    return count


class LossScaler:
    """Dynamic loss scaling: backward of `scale(loss)`, then `unscale_` the gradients; a step
    whose gradients hold inf/NaN is skipped and the scale multiplied by `backoff_factor` (not
    below `min_scale`); after `growth_interval` clean steps in a row it grows by `growth_factor`.

    Disabled (`enabled=False`, fp32/bf16): scale 1, `scale` returns the loss itself, `unscale_`
    touches nothing and never finds an overflow, so a step with it is exactly a step without it.
    The scale is a Python float (no device sync to read it); the overflow check is one flag, all-
    reduced over the default process group so every rank skips the same steps.
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        enabled: bool = True,
        device: torch.device | str = "cpu",
    ):
        assert init_scale > 0 and growth_factor >= 1 and growth_interval >= 1, "checked by the config"
        assert 0 < backoff_factor < 1 and 0 < min_scale <= init_scale, "checked by the config"
        self.enabled = enabled
        self.growth_factor = growth_factor
        self.growth_interval = growth_interval
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.device = torch.device(device)
        self._scale = float(init_scale) if enabled else 1.0
        self._clean_steps = 0  # steps without overflow since the scale last changed
        self.skipped = 0
        """Steps skipped for overflowing gradients, over the whole run (checkpointed)."""

    @property
    def scale_value(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide every gradient by the scale in place; True if any is inf/NaN on any rank.

        DTensor gradients (FSDP, TP) are checked and unscaled on their local shards: the flag is
        all-reduced (max) over the default process group when one is initialised, so a shard's
        overflow on one rank skips the step everywhere. Every rank must call it (a collective).
        """
        if not self.enabled:
            return False
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        seen: set[int] = set()
        for p in params:
            if p.grad is None or id(p) in seen:  # a tied parameter listed twice is unscaled once
                continue
            seen.add(id(p))
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.setdefault((g.device, g.dtype), []).append(g)
        found_inf = torch.zeros(1, device=self.device)
        for (device, _), group in grads.items():
            found = torch.zeros(1, device=device)
            inv_scale = torch.full((1,), 1.0 / self._scale, device=device)
            # One fused pass: g *= inv_scale, and found = 1 if any element is not finite.
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale)
            found_inf += found.to(self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item())

    def update(self, found_inf: bool) -> None:
        """After each step: back off (and count the skip) on overflow, else maybe grow."""
        if not self.enabled:
            return
        if found_inf:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._clean_steps = 0
            self.skipped += 1
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self._scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (checkpoints never unpickle); float64 holds any Python float scale exactly."""
        return {
            "scale": torch.tensor(self._scale, dtype=torch.float64),
            "clean_steps": torch.tensor(self._clean_steps, dtype=torch.int64),
            "skipped": torch.tensor(self.skipped, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A disabled scaler keeps scale 1 (a run resumed in bf16 from an fp16 checkpoint)."""
        if self.enabled:
            self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])

