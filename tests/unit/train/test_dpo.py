"""The DPO objective (train/dpo.py) in one process on the arith-dpo recipe's real pairs, template and
tokenizer with a tiny random model: only the completions' tokens are summed, the first step's loss
is ln 2, micro-batching does not change the gradient, the three references agree, and bad pairs
are one line naming their file and line."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from trainbook.config.load import load_config
from trainbook.config.lora import LoraConfig
from trainbook.config.model import ModelConfig
from trainbook.data.tokenizer import build_tokenizer
from trainbook.errors import TrainbookError
from trainbook.model import build_model
from trainbook.model.lora import apply_lora
from trainbook.parallel.dims import ParallelDims
from trainbook.parallel.runtime import Runtime
from trainbook.train import rl
from trainbook.train.dpo import DpoObjective, dpo_inputs
from tests.conftest import RECIPES

RT = Runtime(0, 1, ParallelDims(1, 1, 1, 1), torch.device("cpu"))
FEW = 64  # pairs of the recipe's file these tests use


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    """(config, tokenizer, the first FEW pairs) of recipes/arith-dpo.toml, read through a copy of
    its preference file cut to FEW lines."""
    tmp = tmp_path_factory.mktemp("dpo")
    lines = (RECIPES / "arith" / "preference.jsonl").read_text().splitlines()[:FEW]
    (tmp / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    cfg = load_config(RECIPES / "arith-dpo.toml", [f'data.sources=[{{name="a", paths=["{tmp / "pairs.jsonl"}"], '
                                                   f'format="preference"}}]'])
    tokenizer = build_tokenizer(cfg.tokenizer, lambda: [])
    return cfg, tokenizer, dpo_inputs(cfg, tokenizer)


def tiny(seed=0):
    return build_model(ModelConfig(name="debug", vocab_size=264, max_seq_len=32), "cpu", seed=seed)


def objective(cfg, pairs, policy, reference, *, micro=4, per_step=8, kind="frozen"):
    d = cfg.dpo.model_copy(update={"pairs_per_step": per_step, "reference": kind})
    return DpoObjective(d, pairs, RT, micro_batch_size=micro, pad_id=0, seed=0, policy=policy, reference=reference)


def test_only_the_completions_tokens_are_summed(arith):
    cfg, tok, pairs = arith
    first = json.loads((RECIPES / "arith" / "preference.jsonl").read_text().splitlines()[0])
    for side, name in ((pairs[0].chosen, "chosen"), (pairs[0].rejected, "rejected")):
        targets = side.ids[1:]
        at = [i for i, m in enumerate(side.trained) if m]
        assert at == list(range(at[0], at[-1] + 1))  # one span
        # The answer and the template's end of turn (EOS here), as fine-tuning trains them; the
        # prompt before it and the newline and document EOS after it are never summed.
        assert tok.decode(targets[at[0]:at[-1] + 1]) == first[name][0]["content"] + "<|endoftext|>"
        assert tok.decode(targets[:at[0]]).endswith(first["prompt"][0]["content"] + "\nA: ")


def test_the_first_step_loss_is_ln2_and_micro_batching_keeps_the_gradient(arith):
    cfg, _, pairs = arith
    grads = {}
    for micro in (1, 4, 8):
        policy = tiny()
        obj = objective(cfg, pairs, policy, copy.deepcopy(policy).requires_grad_(False), micro=micro)
        stream = obj.produce(iter(()))
        total = torch.zeros(())
        for _ in range(8 // micro):
            part = obj.loss(policy, next(stream))
            (part.value / part.divisor).backward()
            total += part.value.detach()
        assert obj.finish(total, 8 // micro).item() == pytest.approx(math.log(2), abs=1e-6)
        figures = obj.figures()
        assert figures["rewards/margins"] == 0 and figures["rewards/chosen"] == 0
        grads[micro] = [p.grad.clone() for p in policy.parameters()]
    for micro in (1, 4):
        for a, b in zip(grads[micro], grads[8]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_precomputed_and_adapter_off_references_equal_the_frozen_one(arith):
    cfg, _, pairs = arith
    policy = tiny()
    frozen = objective(cfg, pairs, policy, copy.deepcopy(policy))
    pre = objective(cfg, pairs, policy, copy.deepcopy(policy), kind="precompute")
    assert pre.reference is None and pre.precomputed.shape == (len(pairs), 2)
    adapted = tiny()
    apply_lora(adapted, LoraConfig(rank=4), seed=0)
    with torch.no_grad():  # adapters that change the policy: the reference must not see them
        for name, p in adapted.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.5)
    off = objective(cfg, pairs, adapted, None, kind="adapter_off")
    for a, b, c in zip(frozen.produce(iter(())), pre.produce(iter(())), off.produce(iter(()))):
        torch.testing.assert_close(b.ref_logp, a.ref_logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(c.ref_logp, a.ref_logp, rtol=0, atol=1e-5)
        with torch.no_grad():  # the adapters are on again for the policy's own forward
            assert not torch.allclose(rl.sequence_logprobs(adapted(c.inputs), c.targets, c.loss_mask), c.ref_logp)
        break


def test_a_step_trains_the_pairs_of_its_number(arith):
    """The pairs of step k are a function of k: a resumed run trains what an unbroken one did."""
    cfg, _, pairs = arith
    policy = tiny()
    one = objective(cfg, pairs, policy, copy.deepcopy(policy))
    stream = one.produce(iter(()))
    unbroken = [next(stream).inputs for _ in range(2 * 3)]  # 3 steps of 2 micro-batches
    step = [2]
    resumed = objective(cfg, pairs, policy, copy.deepcopy(policy))
    resumed.steps_done = lambda: step[0]
    again = resumed.produce(iter(()))
    assert torch.equal(next(again).inputs, unbroken[4]) and torch.equal(next(again).inputs, unbroken[5])


@pytest.mark.parametrize("record, message", [
    ({"prompt": "1+1", "chosen": "2"}, "line 1: no field 'rejected'"),
    ({"prompt": "1+1", "chosen": "2", "rejected": ""}, "line 1: field 'rejected' is empty"),
    ({"prompt": "1+1", "chosen": "2", "rejected": [{"role": "assistant", "content": "3"}]},
     "'prompt', 'chosen' and 'rejected' must all be strings or all message lists"),
    ({"prompt": "1+1", "chosen": "2", "rejected": "2"}, "'chosen' and 'rejected' are the same completion"),
    ({"prompt": "1+1", "chosen": "2" * 40, "rejected": "3"}, "the prompt with its chosen completion is 44 tokens, "
                                                             "more than train.seq_len + 1 = 25"),
])
def test_a_bad_pair_is_one_line_naming_its_file_and_line(arith, tmp_path, record, message):
    cfg, tok, _ = arith
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    bad = cfg.model_copy(update={"data": cfg.data.model_copy(update={
        "sources": [cfg.data.sources[0].model_copy(update={"paths": [str(path)]})]})})
    with pytest.raises(TrainbookError) as e:
        dpo_inputs(bad, tok)
    assert f"'{path}' " in str(e.value) and message in str(e.value), str(e.value)
    assert e.value.where == "data.sources[0]"


def test_a_pair_file_shorter_than_one_window_prepares_and_loads(tmp_path):
    """Pairs (and GRPO's prompts) are read whole by the objective, not cut into seq_len windows:
    a file of one short pair is data enough."""
    from trainbook.commands.preflight import prepare_data
    from trainbook.commands.resolve import resolve
    from trainbook.train.build import build_train_loader

    (tmp_path / "one.jsonl").write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    recipe = tmp_path / "one.toml"
    recipe.write_text(f'extends = "{RECIPES / "arith-dpo.toml"}"\n\n[[data.sources]]\nname = "one"\n'
                      f'paths = ["{tmp_path / "one.jsonl"}"]\nformat = "preference"\n\n[data]\n'
                      f'cache_dir = "{tmp_path / "cache"}"\n')
    res = resolve(recipe, ["dpo.pairs_per_step=1", "train.micro_batch_size=1"], world_size=1)
    data = prepare_data(res, log=lambda *a, **k: None)
    assert sum(len(s) for s in data.train.values()) < res.cfg.train.seq_len
    build_train_loader(res.cfg, data, RT, lambda *a: None).close()
    assert len(dpo_inputs(res.cfg, data.tokenizer)) == 1
