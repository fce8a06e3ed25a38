"""Fine-tuning's masked loss (model/loss.py, `masked=True`): the sum over the targets that are not
`IGNORE`, and a gradient of exactly zero wherever a target is ignored, in the full and the chunked
loss, in fp32, bf16 and (chunked) fp16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainbook.model.loss import IGNORE, full_cross_entropy, linear_cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _problem(n=90, dim=16, vocab=53, seed=0):
    """h (3, n/3, dim), head (vocab, dim), targets (3, n/3) with about half of them ignored,
    whole rows of them included (a prompt) and single ones (a gap inside a turn)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, n // 3, dim, generator=g)
    w = torch.randn(vocab, dim, generator=g) * 0.3
    targets = torch.randint(0, vocab, (3, n // 3), generator=g)
    ignored = torch.rand(targets.shape, generator=g) < 0.5
    ignored[0, :10] = True
    targets[ignored] = IGNORE
    return h, w, targets


def test_the_masked_sum_is_the_cross_entropy_of_the_trained_targets_alone():
    h, w, targets = _problem()
    kept = targets != IGNORE
    want = F.cross_entropy((h @ w.t())[kept], targets[kept], reduction="sum")
    torch.testing.assert_close(full_cross_entropy(h @ w.t(), targets, masked=True), want, rtol=1e-6, atol=1e-6)
    # Chunks of 16 rows over 90: the sum spans every chunk, not only the first.
    got = linear_cross_entropy(h, w, targets, chunk_tokens=16, masked=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_full_loss_gives_masked_logits_a_gradient_of_exactly_zero(dtype):
    h, w, targets = _problem()
    logits = (h @ w.t()).to(dtype).requires_grad_()
    full_cross_entropy(logits, targets, masked=True).backward()
    ignored = targets == IGNORE
    assert logits.grad.dtype == dtype
    assert torch.equal(logits.grad[ignored], torch.zeros_like(logits.grad[ignored]))
    assert (logits.grad[~ignored].abs().sum(-1) > 0).all()  # every trained row has one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_chunked_loss_gives_masked_positions_no_gradient(dtype):
    """The chunked loss never shows its logits; their gradient rows are zero exactly when (1) h's
    gradient is zero at every masked position and (2) what h holds there changes neither the
    loss nor the head's gradient, bit for bit. Chunks of 16 rows over 90 (fp16: its own path)."""
    h, w, targets = _problem()
    ignored = targets == IGNORE

    def run(h):
        h = h.to(dtype).clone().requires_grad_()  # a fresh leaf each run
        head = w.to(dtype).clone().requires_grad_()
        loss = linear_cross_entropy(h, head, targets, chunk_tokens=16, masked=True)
        (loss * 1024).backward()  # a loss scale, as fp16 training back-propagates it
        return loss.detach(), h.grad, head.grad

    loss, grad_h, grad_w = run(h)
    assert torch.equal(grad_h[ignored], torch.zeros_like(grad_h[ignored]))
    assert (grad_h[~ignored].abs().sum(-1) > 0).all()
    other = h.clone()
    other[ignored] = torch.randn(int(ignored.sum()), h.shape[-1], generator=torch.Generator().manual_seed(5)) * 3
    loss2, grad_h2, grad_w2 = run(other)
    assert torch.equal(loss, loss2) and torch.equal(grad_w, grad_w2) and torch.equal(grad_h, grad_h2)
    # And it is the full loss's gradient, to the rounding of the dtype's products.
    hf, wf = (x.to(dtype).float().requires_grad_() for x in (h, w))
    (full_cross_entropy(hf @ wf.t(), targets, masked=True) * 1024).backward()
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((grad_w, wf.grad), (grad_h, hf.grad)):
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=rtol * want.abs().max().item())


def test_masking_leaves_the_unmasked_mean_untouched():
    """`masked=False` is pre-training's mean, whatever targets hold (no IGNORE there)."""
    h, w, _ = _problem()
    targets = torch.randint(0, w.shape[0], h.shape[:2], generator=torch.Generator().manual_seed(1))
    mean = full_cross_entropy(h @ w.t(), targets)
    torch.testing.assert_close(mean * targets.numel(), full_cross_entropy(h @ w.t(), targets, masked=True))
    torch.testing.assert_close(linear_cross_entropy(h, w, targets, chunk_tokens=16), mean, rtol=1e-6, atol=1e-6)
