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

Both return the mean over tokens in fp32 and match to float32 rounding (tests/unit/model/test_loss.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 2048
"""Rows of logits per chunk: 2048 x a 128K vocabulary in fp32 is 1 GiB, 2048 x 2048 is 16 MiB."""


@dataclass(frozen=True)
class ChunkedLoss:
    """How a model computes a chunked loss (`Llama.chunked_loss`)."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    compiled: bool = False
    """The chunk's elementwise work as one compiled kernel (under train.compile)."""


def full_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of logits (B, T, V) against targets (B, T), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, d mean-loss / d logits) of one chunk: logits (C, V) any dtype, targets (C,)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # (C,)
    loss = (lse - logits.gather(1, targets[:, None])[:, 0]).sum()
    grad = torch.exp(logits - lse[:, None]) - F.one_hot(targets, logits.shape[1]).to(logits.dtype)
    return loss, grad / n


@functools.cache
def _compiled_chunk():
    # One graph per chunk shape (the last chunk may be shorter): compiled on first use only.
    return torch.compile(_chunk_loss_and_grad, dynamic=False)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens: int, compiled: bool):
        n = h.shape[0]
        # The head runs in the compute dtype, as nn.Linear would under autocast; the loss in fp32.
        device_type = h.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        chunk_fn = _compiled_chunk() if compiled else _chunk_loss_and_grad
        with torch.autocast(device_type, enabled=False):
            w = weight.to(dtype)
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, n, chunk_tokens):
                hc = h[start:start + chunk_tokens].to(dtype)  # (C, dim)
                loss, grad = chunk_fn(hc @ w.t(), targets[start:start + chunk_tokens], n)
                total += loss
                grad = grad.to(dtype)  # (C, V)
                grad_h[start:start + chunk_tokens] = grad @ w
                if dtype == torch.float32:
                    grad_w.addmm_(grad.t(), hc)
                else:  # low-precision product, accumulated over chunks in fp32
                    grad_w.add_(grad.t() @ hc)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS, compiled: bool = False) -> torch.Tensor:
    """Mean cross entropy of `h @ weight.T` (h (B, T, dim) or (N, dim), weight (V, dim)) against
    targets (B, T) or (N,), without materialising more than `chunk_tokens` rows of logits."""
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1),
                                     chunk_tokens, compiled)
