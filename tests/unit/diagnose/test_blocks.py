"""Block names under the wrappers' name parts: the block a parameter belongs to, the module that
is a block, and the order blocks are listed in (per-layer statistics, triage, the OOM breakdown)."""

from __future__ import annotations

from torch import nn

from trainbook.diagnose.blocks import block_index, block_of, block_order, unwrapped
from trainbook.diagnose.memory import blocks_of


def test_a_parameter_belongs_to_its_block_whatever_wraps_it():
    assert block_of("layers.3.attention.wq.weight") == "layers.3"
    assert block_of("_orig_mod.module.layers.12._checkpoint_wrapped_module.feed_forward.w1.weight") == "layers.12"
    assert [block_of(n) for n in ("tok_embeddings.weight", "norm.weight", "output.weight")] == [
        "embed", "norm", "output"]
    assert unwrapped("module.layers.0._orig_mod.attention") == ["layers", "0", "attention"]


def test_the_block_module_is_the_outermost_one_named_layers_i():
    assert [block_index(n) for n in ("layers.3", "_orig_mod.layers.3", "module.layers.10")] == [3, 3, 10]
    for inside in ("layers.3._checkpoint_wrapped_module", "layers.3.attention", "sublayers.3", "layers", ""):
        assert block_index(inside) is None, inside


def test_blocks_of_a_wrapped_model_are_its_blocks():
    model = nn.Module()
    model.module = nn.Module()  # as DDP holds the model
    model.module.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(2, 2)) for i in range(2)})
    found = blocks_of(model)
    assert list(found) == ["block 0", "block 1"] and found["block 1"] is model.module.layers["1"]


def test_blocks_are_listed_embed_layers_by_number_norm_then_the_rest():
    names = ["output", "layers.10", "norm", "layers.2", "embed"]
    assert sorted(names, key=block_order) == ["embed", "layers.2", "layers.10", "norm", "output"]
