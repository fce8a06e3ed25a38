"""The chunked loss (model/loss.py) is the full cross entropy, without the full logits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainbook.model.loss import full_cross_entropy, linear_cross_entropy


def _problem(n=300, dim=32, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, n // 3, dim, generator=g, requires_grad=True)
    w = (torch.randn(vocab, dim, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, vocab, (3, n // 3), generator=g)
    return h, w, targets


def _loss_and_grads(fn):
    h, w, targets = _problem()
    loss = fn(h, w, targets)
    (loss * 0.5).backward()  # a scaled loss, as accumulation and loss scaling back-propagate it
    return loss.detach(), h.grad, w.grad


def _full(h, w, t):
    return full_cross_entropy(h @ w.t(), t)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_loss_and_gradients_are_the_full_ones(compiled):
    """Chunks of 128 rows over 300 (the last one short): loss and both gradients equal the full
    cross entropy's to float32 rounding (1e-6)."""
    want = _loss_and_grads(_full)
    got = _loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=128, compiled=compiled))
    for a, b, name in zip(got, want, ("loss", "grad h", "grad w")):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert got[0].dtype == torch.float32


def test_bf16_autocast_runs_the_head_in_bf16_and_the_loss_in_fp32():
    """Under autocast the chunked loss is the full loss of bf16 logits (nn.Linear's dtype there),
    to bf16 rounding of the gradient products."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(_full)
        got = _loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=64))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[0].dtype == torch.float32
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op produced while active."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_no_tensor_the_size_of_the_full_logits_is_ever_made():
    """Forward and backward of 300 tokens x 97 classes in chunks of 64: nothing larger than one
    chunk's logits (64 x 97) or the hidden states' gradient (300 x 32) is produced; the full
    loss makes 300 x 97 tensors."""
    sizes = {}
    for name, fn in (("full", _full), ("chunked", lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=64))):
        h, w, t = _problem()
        with _Largest() as seen:
            fn(h, w, t).backward()
        sizes[name] = seen.most
    assert sizes["full"] >= 300 * 97
    assert sizes["chunked"] <= max(64 * 97, 300 * 32) < 300 * 97
