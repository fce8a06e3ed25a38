"""`[moe]` at resolution: what does not fit is one line naming the key, and bias balancing gives
the routers their selection bias in the resolved config."""

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
], ids=["dense", "aux-loss-pp", "compile"])
def test_what_does_not_fit_is_one_line(recipe, overrides, world, key, says):
    with pytest.raises(TrainbookError) as e:
        resolve(recipe, overrides, world_size=world)
    assert e.value.where == f"{recipe}: {key}" and says in str(e.value), (e.value.where, str(e.value))
