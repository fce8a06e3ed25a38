"""The one resolution: batch arithmetic, `micro_batch_size = "auto"`, and errors that name the fix."""

from pathlib import Path

import pytest

from tests.conftest import RECIPES
from trainbook.commands.resolve import resolve
from trainbook.errors import TrainbookError
from trainbook.sizes import GiB

DEFAULT = RECIPES / "tiny-shakespeare.toml"


def _error(recipe: Path, overrides: list[str], world_size: int) -> TrainbookError:
    with pytest.raises(TrainbookError) as info:
        resolve(recipe, overrides, world_size)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("world_size, micro_batch", [(1, 8), (2, 4), (4, 2)])
def test_auto_keeps_the_global_batch_on_every_world_size(world_size, micro_batch):
    res = resolve(DEFAULT, [], world_size, device_memory=80 * GiB)
    assert res.cfg.train.micro_batch_size == micro_batch and res.micro_batch_chosen
    assert res.accum_steps == 1 and res.tokens_per_step == 2048
    assert res.dims.dp == world_size


def test_auto_takes_a_smaller_micro_batch_when_the_largest_does_not_fit():
    """8 x 4096-token samples of the `debug` model do not fit 64 MiB by plan's estimate; 1 does."""
    over = ["model.name=debug", "model.max_seq_len=4096", "train.seq_len=4096", "train.global_batch_tokens=32768"]
    assert resolve(DEFAULT, over, 1).cfg.train.micro_batch_size == 8  # no limit: the largest
    small = resolve(DEFAULT, over, 1, device_memory=64 << 20)
    assert small.cfg.train.micro_batch_size < 8
    assert small.accum_steps * small.cfg.train.micro_batch_size == 8  # the same global batch


def test_a_fixed_micro_batch_that_cannot_split_the_batch_names_the_overrides_that_would():
    e = _error(DEFAULT, ["train.micro_batch_size=8"], 2)
    assert e.where == f"{DEFAULT}: train.global_batch_tokens"
    assert "256 x 8 x 2 = 4096" in e.message
    assert "train.micro_batch_size=auto" in e.message and "train.micro_batch_size=4" in e.message
    assert "train.global_batch_tokens=4096" in e.message
    # ... and each named fix works.
    for fix in ("train.micro_batch_size=auto", "train.micro_batch_size=4", "train.global_batch_tokens=4096"):
        assert resolve(DEFAULT, ["train.micro_batch_size=8", fix], 2).tokens_per_step >= 2048


def test_auto_needs_a_global_batch_and_whole_samples_per_rank(tmp_path):
    e = _error(DEFAULT, ["train.global_batch_tokens=1000"], 1)
    assert "train.global_batch_tokens=1024" in e.message
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'extends = "{DEFAULT}"\n[train]\nglobal_batch_tokens = 2048\n')
    e = _error(recipe, ["train.global_batch_tokens=256", "train.seq_len=128"], 4)
    assert "over 4 data-parallel ranks" in e.message and "train.global_batch_tokens=512" in e.message


def test_pipeline_checks_happen_before_any_process(tmp_path):
    e = _error(DEFAULT, ["parallel.pp=2", "parallel.dp_shard=1", "data.packing=document"], 2)
    assert e.where == f"{DEFAULT}: data.packing"
    e = _error(DEFAULT, ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_microbatches=3",
                         "train.micro_batch_size=8"], 2)
    assert e.where == f"{DEFAULT}: parallel.pp_microbatches" and "multiple of 3" in e.message


def test_pad_packing_of_text_is_refused_naming_data_packing():
    """Padding is left out of the loss through its mask; text trains every token and has none."""
    e = _error(DEFAULT, ["data.packing=pad"], 1)
    assert e.where == f"{DEFAULT}: data.packing" and "pads conversations" in e.message
