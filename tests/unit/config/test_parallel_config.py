"""`[parallel]` at resolution: a layout context parallelism cannot run yet, a gradient compression
setting of the other data-parallel implementation, and delayed synchronisation beside what it
cannot take, are one line naming the key."""

from __future__ import annotations

import pytest

from tests.conftest import RECIPES
from trainbook.commands.resolve import resolve
from trainbook.errors import TrainbookError

TINY = RECIPES / "tiny-shakespeare.toml"
MOE = RECIPES / "moe-tiny-shakespeare.toml"


@pytest.mark.parametrize(("recipe", "overrides", "world", "key", "says"), [
    (TINY, ["parallel.cp=2", "parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=1"], 8, "parallel.cp",
     "context parallelism with both pipeline (pp = 2) and tensor parallelism (tp = 2) is not built yet"),
    (MOE, ["parallel.cp=2", "parallel.ep=2", "parallel.dp_shard=2"], 4, "parallel.cp",
     "context parallelism with expert parallelism (ep = 2) is not built yet"),
    (TINY, ["parallel.cp=2", "parallel.data_parallel=ddp", "parallel.dp_shard=1"], 2, "parallel.cp",
     "ddp does not take it"),
    (TINY, ["parallel.grad_compression=powersgd"], 2, "parallel.grad_compression",
     "grad_compression = powersgd is a DDP communication hook; FSDP2 reduces in bf16 with parallel.reduce_dtype"),
    (TINY, ["parallel.reduce_dtype=bf16", "parallel.data_parallel=ddp", "parallel.dp_replicate=2",
            "parallel.dp_shard=1"], 2, "parallel.reduce_dtype", "reduce_dtype = bf16 is FSDP2's; DDP compresses with"),
    (TINY, ["parallel.grad_compression=bf16", "parallel.data_parallel=ddp", "parallel.dp_shard=1", "parallel.tp=2"],
     2, "parallel.grad_compression", "gradient compression with tp = 2 is not built yet"),
    (TINY, ["parallel.sync_every=4"], 2, "parallel.sync_every",
     "sync_every = 4 trains whole replicas apart: it needs parallel.data_parallel = \"ddp\""),
    (TINY, ["parallel.sync_every=4", "parallel.data_parallel=ddp", "parallel.dp_shard=1", "parallel.tp=2"], 2,
     "parallel.sync_every", "sync_every with tp = 2 is not built yet"),
    (TINY, ["parallel.sync_every=4", "parallel.data_parallel=ddp", "parallel.dp_shard=1", "parallel.dp_replicate=2",
            "parallel.grad_compression=bf16"], 2, "parallel.sync_every", "sends no gradients to compress"),
], ids=["pp-tp", "ep", "ddp", "compression-fsdp", "reduce-dtype-ddp", "compression-tp", "local-sgd-fsdp",
        "local-sgd-tp", "local-sgd-compression"])
def test_what_the_layout_cannot_run_is_one_line(recipe, overrides, world, key, says):
    with pytest.raises(TrainbookError) as e:
        resolve(recipe, overrides, world_size=world)
    assert e.value.where == f"{recipe}: {key}" and says in str(e.value), (e.value.where, str(e.value))


def test_context_parallelism_with_a_pipeline_resolves():
    dims = resolve(TINY, ["parallel.cp=2", "parallel.pp=2", "parallel.dp_shard=1"], world_size=4).dims
    assert (dims.pp, dims.cp, dims.dp_cp) == (2, 2, 2)
