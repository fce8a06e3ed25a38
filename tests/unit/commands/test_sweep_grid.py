import pytest

from trainbook.commands.sweep import split_grid
from trainbook.errors import TrainbookError


def test_a_comma_makes_an_axis_and_the_rest_is_fixed():
    fixed, axes = split_grid(["optim.lr=1e-4,3e-4", "train.max_steps=10", "train.global_batch_tokens=2048,4096"])
    assert fixed == ["train.max_steps=10"]
    assert axes == {"optim.lr": ["1e-4", "3e-4"], "train.global_batch_tokens": ["2048", "4096"]}


def test_commas_inside_lists_tables_and_quotes_are_values():
    fixed, axes = split_grid(['train.freeze=["a.*", "b.*"]', 'run.name="x,y"', "parallel.pp_split=[1,1],[2,0]"])
    assert fixed == ['train.freeze=["a.*", "b.*"]', 'run.name="x,y"']
    assert axes == {"parallel.pp_split": ["[1,1]", "[2,0]"]}


@pytest.mark.parametrize("args,message", [
    (["optim.lr=1e-3"], "no axis to sweep"),
    (["optim.lr=1e-3,,2e-3"], "an empty value"),
    (["optim.lr=1e-3,2e-3", "optim.lr=4e-3,5e-3"], "this key is swept twice"),
    (["optim.lr"], "expected key.path=value"),
])
def test_bad_grids(args, message):
    with pytest.raises(TrainbookError, match=message):
        split_grid(args)
