"""The chunked loss (model/loss.py) is the full cross entropy, without the full logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trainbook.model.loss import full_cross_entropy, linear_cross_entropy
from trainbook.precision import LossScaler


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


def _scaled_grads(fn, h0, w0, dtype):
    """Loss and unscaled gradients of h and the head, as the trainer's fp16 step takes them:
    autocast around forward, backward of the loss times the loss scale, then `unscale_`."""
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    scaler = LossScaler() if dtype == torch.float16 else LossScaler(enabled=False)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = fn(h, w)
    scaler.scale(loss).backward()
    assert not scaler.unscale_([h, w])
    return loss.detach(), h.grad, w.grad


def _fp16_full_logits(h0, w0, t):
    """The full-logit fp16 path (`_scaled_grads` of the fp16 head and `full_cross_entropy`), its
    fp16 products written as what they are: fp32 products of fp16 operands, rounded to fp16. A CPU
    without fp16 matmul kernels runs the real path at ~1 GFLOP/s against ~40 in fp32, so at the
    large size it costs minutes; `test_the_fp16_full_logit_path_is_fp32_products_rounded_to_fp16` holds
    this one to the real path."""
    scale = LossScaler().scale(torch.ones(())).item()
    h16, w16 = h0.half().float(), w0.half().float()
    logits = (h16 @ w16.t()).half().requires_grad_()  # autocast's fp16 linear
    loss = full_cross_entropy(logits[None], t[None])  # the loss upcasts: fp32 over fp16 logits
    (loss * scale).backward()  # the logits' gradient in fp16, as autocast hands it to the linear
    d = logits.grad.float()
    return loss.detach(), (d @ w16).half().float() / scale, (d.t() @ h16).half().float() / scale


def test_the_fp16_full_logit_path_is_fp32_products_rounded_to_fp16():
    """512 tokens x a 4,096 vocabulary: `_fp16_full_logits` against autocast's real fp16 path. The
    loss is bitwise equal, and so is the head's gradient on a CPU without fp16 kernels; h's gradient sums 4,096 terms in another order,
    so a few entries differ in the last fp16 bit (measured: 0.3% of them at 2,048 x 32,768)."""
    n, vocab, dim = 512, 4096, 8
    g = torch.Generator().manual_seed(1)
    h0, w0 = torch.randn(n, dim, generator=g), torch.randn(vocab, dim, generator=g) * 0.02
    t = torch.randint(0, vocab, (n,), generator=g)
    real = _scaled_grads(lambda h, w: full_cross_entropy(F.linear(h, w)[None], t[None]), h0, w0, torch.float16)
    emulated = _fp16_full_logits(h0, w0, t)
    assert torch.equal(real[0], emulated[0])
    scale = LossScaler().scale(torch.ones(())).item()

    def ulps(i: int) -> torch.Tensor:  # |real - emulated| in units of the last place of the fp16 entries
        scaled = real[i] * scale  # the fp16 entries backward produced, before `unscale_`
        ulp = torch.ldexp(torch.ones_like(scaled), torch.frexp(scaled).exponent - 11).clamp(min=2.0**-24)
        return (real[i] - emulated[i]).abs() * scale / ulp

    assert ulps(1).max() <= 1 and (ulps(1) > 0).float().mean() < 0.05
    if not _fp16_kernels():
        assert torch.equal(real[2], emulated[2])
    else:  # AVX512-FP16 kernels sum the head's 512 products in their own order and rounding
        assert ulps(2).max() <= 8 and (ulps(2) > 0).float().mean() < 0.01  # measured: 7 ulps, 0.24%


def _fp16_kernels() -> bool:
    """Whether this CPU has native fp16 arithmetic (AVX512-FP16, which torch's fp16 matmul uses)."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "avx512_fp16" in cpuinfo.read_text()


@pytest.mark.slow  # ~1.5 min here and ~5 GB: the full logits of 16K tokens x a 32K vocabulary
def test_fp16_chunked_gradients_are_as_good_as_the_full_logit_fp16_path():
    """16,384 tokens x a 32,768 vocabulary, the trainer's loss scale (2^16): the off-target entries
    of (softmax - one-hot) / n are ~2e-9, under fp16's smallest subnormal. Against the full-logit
    fp16 path (fp16 head, fp32 loss; `_fp16_full_logits`), the chunked fp16 gradients of h and of
    the head lose no entry (at most 1e-5 of the entries nonzero there are zero here: sums that
    cancel), differ by at most 2^-9 of the largest entry (fp16 rounding of products over 32K
    terms; measured 0.17 and 0.20 of that bound), and are as close to the fp32 gradients as the
    full path's (measured 1.00x and 1.006x). Storing the gradient at 1/n in fp16 zeroes 61% of the
    head's gradient. dim 8: the fp16 matmuls of the chunked path are the test's cost."""
    n, vocab, dim = 16384, 32768, 8
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(n, dim, generator=g)
    w0 = torch.randn(vocab, dim, generator=g) * 0.02
    t = torch.randint(0, vocab, (n,), generator=g)
    truth = _scaled_grads(lambda h, w: linear_cross_entropy(h, w, t), h0, w0, torch.float32)
    full = _fp16_full_logits(h0, w0, t)
    got = _scaled_grads(lambda h, w: linear_cross_entropy(h, w, t), h0, w0, torch.float16)
    torch.testing.assert_close(got[0], full[0], rtol=1e-6, atol=1e-6)
    for name, a, ref, exact in (("h", got[1], full[1], truth[1]), ("head", got[2], full[2], truth[2])):
        lost = ((a == 0) & (ref != 0)).sum().item()
        assert lost <= 1e-5 * a.numel(), f"grad {name}: {lost} entries nonzero on full logits are zero chunked"
        assert (a - ref).abs().max() <= 2.0**-9 * ref.abs().max(), f"grad {name}"
        assert (a - exact).norm() <= 1.1 * (ref - exact).norm(), f"grad {name} further from fp32 than the full path"


def test_fp16_weights_get_fp16_gradients_after_the_loss_scale():
    """fp16 parameters without autocast (FSDP's fp16 policy): the gradients come back in fp16, cast
    after the loss scale, and match the full fp16 logits' to fp16 rounding."""
    grads = {}
    for name, fn in (("full", lambda h, w, t: full_cross_entropy(F.linear(h, w), t)),
                     ("chunked", lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=64))):
        h, w, t = _problem()
        h, w = h.detach().half().requires_grad_(), w.detach().half().requires_grad_()
        (fn(h, w, t) * 2.0**16).backward()
        grads[name] = h.grad, w.grad
    for a, b in zip(grads["chunked"], grads["full"]):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a.float(), b.float(), rtol=4e-3, atol=4e-3 * b.abs().max().item())


class _Ops(TorchDispatchMode):
    """The matmuls run and the shapes of every tensor an op allocated while active (not views)."""

    def __init__(self):
        super().__init__()
        self.matmuls = 0
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.matmuls += 1
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.add((tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_evaluation_computes_the_training_loss_and_no_gradient(dtype, compiled):
    """Under no_grad (evaluation), or when neither input requires a gradient, the chunked loss is
    the training path's (eager: the same ops on the same chunks, bit for bit; compiled: another
    graph of the same ops, so to float32 rounding), with one matmul per chunk (the head) instead of
    three, and no fp32 tensor the shape of either gradient (300 x 32, 97 x 32; the head's cast to
    the compute dtype is not one)."""
    h, w, t = _problem()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        with _Ops() as training:
            want = linear_cross_entropy(h, w, t, chunk_tokens=128, compiled=compiled)
        with torch.no_grad(), _Ops() as evaluation:
            got = linear_cross_entropy(h, w, t, chunk_tokens=128, compiled=compiled)
        frozen = linear_cross_entropy(h.detach(), w.detach(), t, chunk_tokens=128, compiled=compiled)
    if compiled:
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=0)
    else:
        assert torch.equal(got, want.detach()) and torch.equal(frozen, want.detach())
    assert not frozen.requires_grad
    if not compiled:  # compiled kernels run below the dispatcher
        assert (training.matmuls, evaluation.matmuls) == (3 * 3, 3)
    grad_shapes = {((300, 32), torch.float32), ((97, 32), torch.float32)}
    assert grad_shapes <= training.shapes and not grad_shapes & evaluation.shapes


@pytest.mark.parametrize("masked", [False, True], ids=["mean", "masked"])
def test_the_chunk_gradient_makes_no_one_hot_and_is_softmax_minus_one_hot_bit_for_bit(masked):
    """d loss / d logits of a chunk, eager: the one subtracted at each target in place is the
    same arithmetic as subtracting a one-hot (the bits of every run and baseline stay), and no
    tensor of the chunk's (C, V) shape other than fp32 is made: a one-hot (int64 then fp32) is
    2 GiB and 1 GiB a chunk at a 128K vocabulary, and was most of the eager chunk's time."""
    from trainbook.model.loss import IGNORE, _softmax_minus_one_hot

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 97, generator=g) * 4
    targets = torch.randint(0, 97, (64,), generator=g)
    if masked:
        targets[::3] = IGNORE
    lse = torch.logsumexp(logits, dim=-1)
    want = torch.exp(logits - lse[:, None]) - F.one_hot(targets.clamp(min=0), 97).float()
    if masked:
        want = torch.where((targets >= 0)[:, None], want, 0.0)
    with _Ops() as ops:
        got = _softmax_minus_one_hot(logits, lse, targets, masked)
    assert torch.equal(got, want)
    assert {dtype for shape, dtype in ops.shapes if shape == (64, 97)} == {torch.float32}
