import torch

from trainbook.config import ModelConfig, OptimConfig, PrecisionConfig
from trainbook.data.samples import Batch
from trainbook.model import build_model, resolve
from trainbook.model.surgery import freeze, reinit, resize_vocab, trainable_summary
from trainbook.precision import Precision
from trainbook.train.optim import build_optimizer, optimizer_state
from trainbook.phase import PhaseTracker
from trainbook.train.engine import LocalEngine
from trainbook.train.step import Step


def _model(**overrides):
    return build_model(resolve(ModelConfig(name="debug", **overrides)), "cpu", seed=0)


def _batches(vocab: int):
    g = torch.Generator().manual_seed(1)
    while True:
        tokens = torch.randint(0, vocab, (2, 17), generator=g)
        yield Batch(tokens[:, :-1], tokens[:, 1:], None)


def test_frozen_parameters_stay_bitwise_and_get_no_state():
    model = _model()
    assert freeze(model, ["tok_embeddings.*", "layers.0.*", "nothing.here"]) == ["nothing.here"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    batches = _batches(512)
    for _ in range(3):
        precision = Precision(PrecisionConfig(), torch.device("cpu"))
        Step.next_token(LocalEngine.one_process(model, precision), optimizer, 2, 1.0,
                        precision.loss_scaler(), PhaseTracker())(batches)
    frozen = [n for n in before if n.startswith(("tok_embeddings.", "layers.0."))]
    assert frozen and all(torch.equal(dict(model.named_parameters())[n], before[n]) for n in frozen)
    assert all(dict(model.named_parameters())[n].grad is None for n in frozen)
    assert not any(torch.equal(p, before[n]) for n, p in model.named_parameters() if n not in frozen)
    assert set(optimizer_state(model, optimizer)) == set(before) - set(frozen)
    assert "trainable" in trainable_summary(model)


def test_resize_adds_mean_rows_and_keeps_the_old_ones():
    model = _model(vocab_size=100, tie_embeddings=True)
    old = model.tok_embeddings.weight.detach().clone()
    resize_vocab(model, 104, "mean", seed=0)
    new = model.tok_embeddings.weight
    assert new.shape == (104, 64) and torch.equal(new[:100], old)
    assert torch.allclose(new[100:], old.mean(0).expand(4, -1))
    assert model.output.weight is new  # still tied
    assert model(torch.tensor([[103, 5]])).shape == (1, 2, 104)


def test_resize_untied_normal_rows():
    model = _model(vocab_size=100)
    head = model.output.weight.detach().clone()
    resize_vocab(model, 110, "normal", seed=0)
    assert model.output.weight.shape == (110, 64) and torch.equal(model.output.weight[:100], head)
    assert model.tok_embeddings.weight.shape == (110, 64)
    assert 0.005 < model.output.weight[100:].std().item() < 0.05  # init_std 0.02


def test_reinit_changes_only_what_matches():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert reinit(model, ["output.*", "norm.weight"], std=0.02, seed=3) == []
    after = dict(model.named_parameters())
    assert not torch.equal(after["output.weight"], before["output.weight"])
    assert torch.equal(after["norm.weight"], torch.ones_like(before["norm.weight"]))
    assert all(torch.equal(after[n], before[n]) for n in before if n not in ("output.weight", "norm.weight"))
