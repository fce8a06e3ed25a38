"""`[moe]` and `parallel.ep` at resolution: what does not fit is one line naming the key, and bias
balancing gives the routers their selection bias in the resolved config."""

from __future__ import annotations

import pytest

from tests.conftest import RECIPES
from trainbook.commands.resolve import resolve
from trainbook.errors import TrainbookError

MOE = RECIPES / "moe-tiny-shakespeare.toml"


def test_bias_balancing_gives_the_routers_a_bias():
    assert not resolve(MOE, ["moe.balance=none"], world_size=1).cfg.model.router_bias
    assert resolve(MOE, ["moe.balance=bias"], world_size=1).cfg.model.router_bias


@pytest.mark.parametrize(("recipe", "overrides", "world", "key", "says"), [
    (RECIPES / "tiny-shakespeare.toml", ["moe.balance=aux_loss"], 1, "moe.balance", "has none (model.n_experts is unset)"),
    (MOE, ["parallel.pp=2"], 2, "moe.balance", "moe.balance = aux_loss is not supported with pp > 1"),
    (MOE, ["train.compile=true"], 1, "train.compile", "a mixture of experts trains eager for now"),
    (RECIPES / "tiny-shakespeare.toml", ["parallel.ep=2"], 2, "parallel.ep", "model 'tiny' is dense"),
    (MOE, ["parallel.ep=3", "parallel.dp_shard=3"], 3, "parallel.ep", "8 experts do not split evenly over ep = 3"),
    (MOE, ["parallel.ep=2", "parallel.dp_shard=1", "parallel.dp_replicate=2"], 2, "parallel.ep",
     "ep = 2 must divide dp_shard = 1"),
    (MOE, ["parallel.ep=2", "parallel.tp=2"], 4, "parallel.ep", "with tensor parallelism (tp = 2) is not built yet"),
    (MOE, ["parallel.ep=2", "parallel.pp=2", "moe.balance=none"], 4, "parallel.ep",
     "with pipeline parallelism (pp = 2) is not built yet"),
    (MOE, ["parallel.ep=2", "train.activation_checkpoint=selective"], 2, "train.activation_checkpoint",
     "selective activation checkpointing does not run with expert parallelism yet"),
], ids=["dense", "aux-loss-pp", "compile", "ep-dense", "ep-experts", "ep-dp-shard", "ep-tp", "ep-pp", "ep-selective"])
def test_what_does_not_fit_is_one_line(recipe, overrides, world, key, says):
    with pytest.raises(TrainbookError) as e:
        resolve(recipe, overrides, world_size=world)
    assert e.value.where == f"{recipe}: {key}" and says in str(e.value), (e.value.where, str(e.value))
