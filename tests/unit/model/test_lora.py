"""LoRA (model/lora.py) on the real decoder: the adapted model starts as the base model bitwise,
merging changes nothing, the scale is alpha / rank, and a training step moves the adapters only."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainbook.config import LoraConfig, OptimConfig, PrecisionConfig
from trainbook.config.model import ModelConfig
from trainbook.data.samples import Batch
from trainbook.errors import TrainbookError
from trainbook.model import build_model, resolve
from trainbook.model.lora import LoRALinear, apply_lora, merged_state_dict, targeted
from trainbook.phase import PhaseTracker
from trainbook.precision import Precision, hold_frozen_projections
from trainbook.train.engine import LocalEngine
from trainbook.train.objective import NextTokenLoss
from trainbook.train.optim import build_optimizer
from trainbook.train.step import Step

CPU = torch.device("cpu")


def _model(**overrides):
    # qkv_bias: the Qwen2 option, so a frozen bias is covered too.
    return build_model(resolve(ModelConfig(name="debug", **overrides)), CPU, seed=0)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


def _randomise_b(model: nn.Module) -> None:
    """Give every B a value, as training would (B starts at zero)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=g) * 0.05)


@pytest.mark.parametrize("targets", ["all-linear", ["wq", "wv"]], ids=["all-linear", "wq-wv"])
def test_at_step_0_the_adapted_model_is_the_base_model_bitwise(targets):
    base, adapted = _model(qkv_bias=True), _model(qkv_bias=True)
    apply_lora(adapted, LoraConfig(rank=4, alpha=8, dropout=0.1, targets=targets), seed=3)
    adapted.train()  # dropout active: it only touches the adapter's input, whose B is zero
    tokens = _tokens()
    with torch.no_grad():
        got, want = adapted(tokens), base(tokens)
    assert torch.equal(got, want), f"the logits differ by up to {(got - want).abs().max():.3g}"

    # The init that makes it so, as PEFT's: B zero, A kaiming-uniform, i.e. uniform(+-1/sqrt(in)).
    wq = adapted.layers["0"].attention.wq
    assert isinstance(wq, LoRALinear) and not wq.lora_b.weight.any()
    bound = 1 / math.sqrt(wq.in_features)
    assert wq.lora_a.weight.abs().max() <= bound and wq.lora_a.weight.abs().max() > 0.8 * bound
    # The base's names are the base's tensors: checkpoints and HF export find them where they were.
    names = adapted.state_dict().keys()
    assert set(base.state_dict()) <= set(names)
    assert torch.equal(adapted.state_dict()["layers.0.attention.wq.weight"], base.state_dict()["layers.0.attention.wq.weight"])
    assert {"layers.0.attention.wq.lora_a.weight", "layers.0.attention.wq.lora_b.weight"} <= set(names)


def test_merged_weights_give_the_adapted_model_s_logits():
    adapted = _model()
    apply_lora(adapted, LoraConfig(rank=4, alpha=16), seed=3)
    _randomise_b(adapted)
    merged = _model()
    merged.load_state_dict(merged_state_dict(adapted.state_dict(), scale=16 / 4))
    tokens = _tokens()
    with torch.no_grad():
        want, got = adapted(tokens), merged(tokens)
        assert (want - _model()(tokens)).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    wq = adapted.layers["0"].attention.wq
    assert torch.equal(wq.merged_weight(), merged.state_dict()["layers.0.attention.wq.weight"])


def test_the_adapter_is_scaled_by_alpha_over_rank():
    # W = 0 and a hand-set B A: the output is alpha / rank * B A x, exact in small integers.
    base = nn.Linear(3, 2, bias=True)
    with torch.no_grad():
        base.weight.zero_()
        base.bias.copy_(torch.tensor([1.0, -1.0]))
    lora = LoRALinear(base, rank=2, alpha=6, dropout=0.0)  # scale 6 / 2 = 3
    assert [n for n, p in lora.named_parameters() if p.requires_grad] == ["lora_a.weight", "lora_b.weight"]
    with torch.no_grad():
        lora.lora_a.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]))  # A (2, 3)
        lora.lora_b.weight.copy_(torch.tensor([[1.0, 0.0], [2.0, -1.0]]))  # B (2, 2)
    x = torch.tensor([[1.0, 2.0, 3.0]])
    # A x = [1, 5]; B A x = [1, 2 - 5] = [1, -3]; times 3, plus the bias [1, -1].
    assert torch.equal(lora(x), torch.tensor([[4.0, -10.0]]))
    assert torch.equal(lora.merged_weight(), torch.tensor([[3.0, 0.0, 0.0], [6.0, -3.0, -3.0]]))


def test_training_moves_the_adapters_only_and_the_optimizer_holds_their_state_alone():
    model = _model(qkv_bias=True)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoraConfig(rank=4, targets=["wq", "wk", "wv", "wo", "w1", "w2", "w3"]), seed=3)
    adapters = {name: p for name, p in model.named_parameters() if ".lora_" in name}
    # The real step and optimizer of a run: AdamW over the trainable parameters, weight decay on.
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    precision = Precision(PrecisionConfig(), CPU)
    step = Step(LocalEngine.one_process(model, precision), NextTokenLoss(2), optimizer, precision.loss_scaler(),
                PhaseTracker(), 1.0, 2)
    g = torch.Generator().manual_seed(0)
    for n in range(1, 4):
        step.tracker.begin_step(n)
        windows = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(2)]
        step(iter([Batch(w[:, :-1], w[:, 1:], None) for w in windows]))

    after = model.state_dict()
    for name, tensor in base.items():
        assert torch.equal(after[name], tensor), f"{name} changed"
    assert all(p.grad is None for name, p in model.named_parameters() if name not in adapters)
    assert all(p.any() for name, p in adapters.items() if name.endswith("lora_b.weight"))  # B trained
    assert {id(p) for p in optimizer.state} == {id(p) for p in adapters.values()}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(adapters)


@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "own-head"])
def test_a_frozen_base_held_in_bf16_trains_bitwise_as_the_fp32_base_under_bf16_autocast(tie):
    """precision.hold_frozen_projections: autocast casts every projection weight to bf16 for its
    matmul; holding the frozen ones in bf16 computes the same bits in half the memory."""
    runs = {}
    for held in ("fp32", "bf16"):
        model = _model(qkv_bias=True, tie_embeddings=tie)
        apply_lora(model, LoraConfig(rank=4, targets=["wq", "wv", "w2"]), seed=3)
        lowered = hold_frozen_projections(model, held) if held == "bf16" else 0
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
        precision = Precision(PrecisionConfig(dtype="bf16"), CPU)
        step = Step(LocalEngine.one_process(model, precision), NextTokenLoss(2), optimizer,
                    precision.loss_scaler(), PhaseTracker(), 1.0, 2)
        g, losses = torch.Generator().manual_seed(0), []
        for n in range(1, 4):
            step.tracker.begin_step(n)
            windows = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(2)]
            losses.append(step(iter([Batch(w[:, :-1], w[:, 1:], None) for w in windows])).loss)
        runs[held] = losses, {k: v for k, v in model.state_dict().items() if ".lora_" in k}, dtypes, lowered

    (losses32, adapters32, _, _), (losses16, adapters16, dtypes, lowered) = runs["fp32"], runs["bf16"]
    assert losses16 == losses32
    assert all(torch.equal(adapters16[k], adapters32[k]) for k in adapters32)
    # Every projection weight of the blocks (7 a block) and an own head went to bf16; the adapters,
    # biases, norms and the embedding table (and a head tied to it) stayed fp32.
    n_blocks = len({k.split(".")[1] for k in dtypes if k.startswith("layers.")})
    assert lowered == 7 * n_blocks + (0 if tie else 1)
    low = {k for k, d in dtypes.items() if d == torch.bfloat16}
    assert all(k.endswith(".weight") and ".lora_" not in k and "norm" not in k for k in low), low
    assert dtypes["tok_embeddings.weight"] == torch.float32 and dtypes["layers.0.attention.wq.bias"] == torch.float32
    assert ("output.weight" in low) == (not tie)


def test_targets_that_name_no_linear_module_are_refused_in_one_line():
    model = _model()
    with pytest.raises(TrainbookError) as e:
        targeted(model, ["wq", "q_proj"])
    assert str(e.value) == ("lora.targets: 'q_proj' names no module of the model (its linear layers: w1, w2, w3, "
                            "wk, wo, wq, wv; or 'all-linear')")
    with pytest.raises(TrainbookError) as e:
        targeted(model, ["attention"])
    assert str(e.value) == "lora.targets: 'attention' names 'layers.0.attention' (Attention), not a linear layer"
    # A longer tail picks one block's layer; `all-linear` every linear layer but the head.
    assert list(targeted(model, ["layers.1.attention.wq"])) == ["layers.1.attention.wq"]
    assert "output" not in targeted(model, "all-linear") and len(targeted(model, "all-linear")) == 7 * model.cfg.n_layers


def test_a_mixture_of_experts_router_gate_is_never_adapted():
    """The router multiplies by its gate's weight itself (fp32): `all-linear` leaves the gates out
    (the dense layer's SwiGLU and the attention projections stay in), and naming one is refused."""
    cfg = resolve(ModelConfig(name="tiny-moe", n_layers=2, vocab_size=64))  # layer 0 dense, layer 1 routed
    model = build_model(cfg, "meta", seed=0)
    chosen = targeted(model, "all-linear")
    assert not any("router" in name for name in chosen)
    assert len(chosen) == 7 + 4  # the dense block's seven; the MoE block's four attention projections
    with pytest.raises(TrainbookError) as e:
        targeted(model, ["gate"])
    assert str(e.value) == ("lora.targets: 'gate' names 'layers.1.feed_forward.router.gate', a mixture of experts' "
                            "router gate, which LoRA does not adapt (the router multiplies by its weight itself, in fp32)")


def test_rank_0_leaves_the_model_as_it_is():
    model = _model()
    assert apply_lora(model, LoraConfig(), seed=3) == []
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
