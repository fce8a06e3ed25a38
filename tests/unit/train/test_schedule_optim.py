
import pytest
import torch
from torch import nn

from trainbook.config import OptimConfig, ScheduleConfig
from trainbook.train.optim import build_optimizer, load_optimizer_state, optimizer_state
from trainbook.train.schedule import LRSchedule


def _lrs(kind: str, warmup=10, steps=100, peak=1.0, floor=0.1) -> list[float]:
    s = LRSchedule(ScheduleConfig(kind=kind, warmup_steps=warmup, min_lr_ratio=floor), peak, steps)
    return [s(i) for i in range(steps)]


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_rises_linearly_to_the_peak(kind):
    lrs = _lrs(kind)
    assert all(b > a for a, b in zip(lrs[:10], lrs[1:11]))
    assert lrs[0] == pytest.approx(1 / 11)
    assert lrs[10] == pytest.approx(1.0)


def test_decays_end_at_the_floor_and_have_their_shape():
    cos, lin, const = _lrs("cosine", steps=110), _lrs("linear", steps=110), _lrs("constant", steps=110)
    assert const[10:] == [1.0] * 100
    # Halfway through the decay both shapes are at the midpoint of peak and floor.
    assert cos[60] == pytest.approx(0.55) and lin[60] == pytest.approx(0.55)
    # Cosine stays higher early, linear falls at a constant rate.
    assert cos[30] > lin[30]
    assert lin[20] - lin[21] == pytest.approx(lin[80] - lin[81])
    s = LRSchedule(ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1), 1.0, 110)
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def test_no_decay_on_norms_biases_and_embeddings_by_default():
    model = Tiny()
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in opt.param_groups}
    assert by_decay[0.1] == {id(model.proj.weight)}
    assert by_decay[0.0] == {id(model.emb.weight), id(model.norm.weight), id(model.norm.bias), id(model.proj.bias)}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))  # tied: once

    opt = build_optimizer(model, OptimConfig(weight_decay=0.1, decay_norms_and_embeddings=True))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1]


def test_optimizer_state_round_trips_by_parameter_name():
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, OptimConfig())
    model.proj(model.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    state = optimizer_state(model, opt)
    assert set(state) == {"emb.weight", "proj.weight", "proj.bias"}  # norm got no gradient
    assert all(isinstance(v, torch.Tensor) for s in state.values() for v in s.values())

    fresh = build_optimizer(model, OptimConfig())
    load_optimizer_state(model, fresh, state)
    for name, p in model.named_parameters():
        if name in state:
            assert torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_clipping_scales_every_gradient_to_the_norm_as_torch_does():
    """The engines' clip (train/engine.py, which norms each mesh's gradients apart) is torch's
    clip_grad_norm_ on one process: the same norm returned, every gradient scaled alike."""
    from trainbook.train.engine import clip_grad_norm

    torch.manual_seed(0)
    ours, theirs = (nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)) for _ in range(2))
    theirs.load_state_dict(ours.state_dict())
    ours(torch.randn(5, 4)).square().sum().backward()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        q.grad = p.grad.clone()
    norm = clip_grad_norm(list(ours.parameters()), 0.5)
    expected = nn.utils.clip_grad_norm_(list(theirs.parameters()), 0.5)
    assert norm > 0.5 and torch.equal(norm, expected)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours.parameters()])) == pytest.approx(0.5)
