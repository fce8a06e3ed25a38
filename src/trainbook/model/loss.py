"""Next-token cross entropy, two ways.

`full_cross_entropy(logits, targets)`: the plain one, on logits the output head already produced
(B, T, V). At a large vocabulary those logits, in fp32 with their gradient, are the largest tensors
of the step: 128K vocab x 8K tokens is 4 GiB each.

`linear_cross_entropy(h, weight, targets, chunk_tokens)`: the output head and the loss together,
`chunk_tokens` rows at a time, so at most one chunk's logits ever exist. Each chunk's gradient is
computed in the forward pass (softmax - one-hot, times the head), and backward only scales what
was kept: the gradient of the hidden states (N, dim) and of the head (V, dim), both the size of
things the step holds anyway. Matmuls: the head forward, and the two gradient products, the same
three as autograd runs on full logits; nothing is recomputed. The elementwise work per chunk (fp32
log-softmax, the gradient) is one compiled kernel when `compiled` (the path `train.compile` takes).
benchmarks/loss.py on 2 CPU cores, forward + backward, fp32: 16,384 tokens, dim 256, vocab 2048:
full eager 802 ms, full compiled 495, chunked eager 656, chunked compiled 491; 2,048 tokens, dim
192, vocab 1024 (one chunk): full eager 26.6 ms, chunked eager 37.3. `train.loss = auto` takes
the chunked loss when compiled or when a micro-batch holds more than one chunk.

fp16 scales each chunk's gradient by a power of two before its fp16 products (`_fp16_loss_and_grads`
says why): stored at 1/n it underflowed, and the loss scale, applied in backward, cannot restore
it. Its cost (`--dtype fp16 --against 580f98c`, same shape, CPU autocast): eager 580 against 419
ms, compiled 244 against 227. Without a gradient to take (evaluation under no_grad) only the loss
is computed, chunk by chunk: one matmul per chunk instead of three (`--pass eval`): eager 78 ms
against 405 before, compiled 69 against 240, full eager 127; at vocab 32768 (`--reps 4`): eager
2,285 against 8,161, compiled 1,569 against 4,277, full eager 6,546.

Both return the mean over tokens in fp32 and match to float32 rounding (tests/unit/model/test_loss.py).
With `masked=True` (fine-tuning's loss masks) a target below 0 (`IGNORE`) is no token: it adds
nothing to the loss and its logits get a gradient of exactly zero, and both return the sum over the
trained tokens; the objective divides it by the step's trained tokens (train/objective.py). The
unmasked path is the one above, unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100
"""The target of a position that is not trained (`masked=True`); Hugging Face's ignore index."""

DEFAULT_CHUNK_TOKENS = 2048
"""Rows of logits per chunk: 2048 x a 128K vocabulary in fp32 is 1 GiB, 2048 x 2048 is 16 MiB."""

FP16_PRODUCT_BOUND = 2.0**15
"""fp16: the most either gradient product of a chunk may reach (half of fp16's largest, 65504,
leaving room for the rounding of its factors); also the largest scale of a chunk's gradient,
whose entries are at most 1."""


@dataclass(frozen=True)
class ChunkedLoss:
    """How a model computes a chunked loss (`Llama.chunked_loss`)."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    compiled: bool = False
    """The chunk's elementwise work as one compiled kernel (under train.compile)."""


def full_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """Mean next-token cross entropy of logits (B, T, V) against targets (B, T), in fp32; with
    `masked`, the sum over the targets that are not `IGNORE`."""
    if masked:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE,
                               reduction="sum")
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor,
                masked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, fp32 logits, their log-sum-exp (C,)) of one chunk: logits (C, V) any dtype,
    targets (C,). The one loss of every path, so evaluation's is training's bit for bit."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # (C,)
    if masked:
        rows = lse - logits.gather(1, targets.clamp(min=0)[:, None])[:, 0]
        return torch.where(targets >= 0, rows, 0.0).sum(), logits, lse
    return (lse - logits.gather(1, targets[:, None])[:, 0]).sum(), logits, lse


def _chunk_loss_only(logits: torch.Tensor, targets: torch.Tensor, masked: bool = False) -> torch.Tensor:
    return _chunk_loss(logits, targets, masked)[0]


def _softmax_minus_one_hot(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                           masked: bool = False) -> torch.Tensor:
    """d summed-loss / d logits (C, V) of fp32 logits with log-sum-exp `lse`; entries in [-1, 1]
    (rows of ignored targets, with `masked`: zero).

    The one is subtracted at each row's target in place: no (C, V) one-hot is made (int64, then
    fp32: 2 GiB and 1 GiB a chunk at a 128K vocabulary, and most of the eager chunk's time). The
    same subtractions as `softmax - one_hot`, so the same bits."""
    grad = (logits - lse[:, None]).exp_()  # (C, V) softmax
    rows = torch.arange(targets.shape[0], device=targets.device)
    if not masked:
        grad[rows, targets] -= 1.0
        return grad
    trained = targets >= 0
    grad[rows, targets.clamp(min=0)] -= 1.0
    return grad.masked_fill_(~trained[:, None], 0.0)


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, n: int,
                         masked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, d mean-loss / d logits) of one chunk: logits (C, V) any dtype, targets (C,)."""
    loss, logits, lse = _chunk_loss(logits, targets, masked)
    return loss, _softmax_minus_one_hot(logits, lse, targets, masked) / n


def _chunk_loss_and_fp16_grad(logits: torch.Tensor, targets: torch.Tensor, w_absmax: torch.Tensor,
                              h_absmax: torch.Tensor,
                              masked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, s * (softmax - one-hot) in fp16, s) of one chunk for fp16 products: s the
    largest power of two (at most 2^15) under which neither product, with the head (max |w|
    `w_absmax`) or with the chunk's hidden states (max |h| `h_absmax`), can leave fp16's range.

    Stored at 1/n (n the micro-batch's tokens) the gradient would be ~1/(V n): 2e-9 at a 32K
    vocabulary and 16K tokens, under fp16's smallest subnormal (6e-8), so every off-target entry
    would be zero, and the loss scale, applied only in backward, could not bring it back. At
    scale s its entries keep fp16's precision; the products are divided by s n in fp32.
    """
    loss, logits, lse = _chunk_loss(logits, targets, masked)
    grad = _softmax_minus_one_hot(logits, lse, targets, masked)  # (C, V)
    # Bounds whatever the order of summation: a row of `grad @ w` is at most
    # sum_v |grad[r, v]| max|w| <= 2 max|w|; a row of `grad.T @ h`, sum_r |grad[r, v]| max|h|.
    col_sum = torch.linalg.vector_norm(grad, 1, dim=0).amax()
    bound = torch.maximum(2 * w_absmax, col_sum * h_absmax)
    s = torch.exp2(torch.floor(torch.log2(FP16_PRODUCT_BOUND / bound))).clamp(max=FP16_PRODUCT_BOUND)
    return loss, (grad * s).to(torch.float16), s


@functools.cache
def _compiled(chunk_fn):
    # One graph per chunk shape (the last chunk may be shorter): compiled on first use only.
    return torch.compile(chunk_fn, dynamic=False)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The head runs in the compute dtype, as nn.Linear would under autocast; the loss in fp32."""
    device_type = h.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def _times(grad: torch.Tensor, grad_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad * grad_out in `dtype`: an fp32 gradient of an fp16 input is cast only after the loss
    scale (in grad_out) has brought it into fp16's range."""
    if grad.dtype == dtype:
        return grad * grad_out
    return torch.mul(grad, grad_out, out=torch.empty_like(grad, dtype=dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens: int, compiled: bool, masked: bool):
        n = 1 if masked else h.shape[0]  # the divisor (masked: 1, the sum); chunks still span every row
        dtype = _compute_dtype(h, weight)
        with torch.autocast(h.device.type, enabled=False):
            if dtype == torch.float16:
                total, grad_h, grad_w = _fp16_loss_and_grads(h, weight.to(dtype), targets, chunk_tokens, compiled,
                                                             n, masked)
            else:
                total, grad_h, grad_w = _loss_and_grads(h, weight, targets, chunk_tokens, compiled, dtype, n, masked)
        ctx.dtypes = h.dtype, weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return _times(grad_h, grad_out, h_dtype), _times(grad_w, grad_out, w_dtype), None, None, None, None


def _loss_and_grads(h, weight, targets, chunk_tokens, compiled, dtype, n, masked):
    """fp32 or bf16 (bf16 has fp32's exponent range): each chunk's gradient at 1/n in the compute
    dtype; grad_h in h's dtype, grad_w accumulated in fp32 and returned in the weight's."""
    chunk_fn = _compiled(_chunk_loss_and_grad) if compiled else _chunk_loss_and_grad
    w = weight.to(dtype)
    grad_h = torch.empty_like(h)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_tokens):
        hc = h[start:start + chunk_tokens].to(dtype)  # (C, dim)
        loss, grad = chunk_fn(hc @ w.t(), targets[start:start + chunk_tokens], n, masked)
        total += loss
        grad = grad.to(dtype)  # (C, V)
        grad_h[start:start + chunk_tokens] = grad @ w
        if dtype == torch.float32:
            grad_w.addmm_(grad.t(), hc)
        else:  # low-precision product, accumulated over chunks in fp32
            grad_w.add_(grad.t() @ hc)
    return total, grad_h, grad_w.to(weight.dtype)


def _fp16_loss_and_grads(h, w, targets, chunk_tokens, compiled, n, masked):
    """fp16 (w: the head in fp16): each chunk's gradient scaled by a power of two into fp16's
    range, the products in fp16 as the full-logit path runs them, divided back in fp32; both
    gradients returned in fp32 (cast after the loss scale, in backward).

    Why this way: products in fp32 would leave the fp16 tensor cores (2x to 16x slower matmuls on
    a GPU), and folding the loss scale into forward needs the scale where the model has none. A
    power of two changes no rounding but the underflow it removes; its cost is one column-sum
    reduction per chunk (fused into the compiled kernel) and two max |.| reductions. With an fp16
    head (FSDP's fp16 policy) the fp32 accumulator is kept until backward instead of an fp16 copy
    made at the end of forward: the same peak (4 + 2 bytes an entry), moved into backward; h's
    gradient (N, dim) is kept in fp32 there, 2 bytes an entry more.
    """
    chunk_fn = _compiled(_chunk_loss_and_fp16_grad) if compiled else _chunk_loss_and_fp16_grad
    w_absmax = torch.linalg.vector_norm(w, float("inf"), dtype=torch.float32)  # max |w|, no (V, dim) temporary
    grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_tokens):
        hc = h[start:start + chunk_tokens].to(torch.float16)  # (C, dim)
        loss, grad, s = chunk_fn(hc @ w.t(), targets[start:start + chunk_tokens], w_absmax, hc.abs().amax().float(),
                                 masked)
        total += loss
        unscale = 1 / (s * n)  # fp32: a 16K-token chunk's 1/n is under fp16's range
        rows = grad_h[start:start + chunk_tokens]
        rows.copy_(grad @ w)
        rows.mul_(unscale)
        grad_w.addcmul_(grad.t() @ hc, unscale)
    return total, grad_h, grad_w


def _loss(h, weight, targets, chunk_tokens, compiled, masked):
    """The mean loss alone, chunk by chunk (evaluation: no gradient products, no gradient buffers)."""
    n = 1 if masked else h.shape[0]
    dtype = _compute_dtype(h, weight)
    chunk_fn = _compiled(_chunk_loss_only) if compiled else _chunk_loss_only
    with torch.autocast(h.device.type, enabled=False):
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk_tokens):
            total += chunk_fn(h[start:start + chunk_tokens].to(dtype) @ w.t(), targets[start:start + chunk_tokens],
                              masked)
    return total / n


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS, compiled: bool = False,
                         masked: bool = False) -> torch.Tensor:
    """Mean cross entropy of `h @ weight.T` (h (B, T, dim) or (N, dim), weight (V, dim)) against
    targets (B, T) or (N,), without materialising more than `chunk_tokens` rows of logits (with
    `masked`: the sum over targets that are not `IGNORE`). Without a gradient to take (no_grad, or
    neither h nor weight requires one), the loss alone."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, chunk_tokens, compiled, masked)
    return _loss(h, weight, targets, chunk_tokens, compiled, masked)
