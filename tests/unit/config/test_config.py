import typing
from pathlib import Path

import pytest
import tomllib

from tests.conftest import RECIPES
from trainbook.config import Config, dump_toml, load_config
from trainbook.errors import TrainbookError


def test_every_shipped_recipe_loads():
    recipes = sorted(RECIPES.glob("*.toml"))
    assert recipes, "no recipes shipped"
    for path in recipes:
        cfg = load_config(path)
        assert isinstance(cfg, Config)
        assert cfg.data.sources, f"{path.name} has no data"


def test_defaults_and_name_from_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[train]\nmax_steps = 5\n")
    cfg = load_config(path)
    assert cfg.train.max_steps == 5
    assert cfg.run.name == "mine"
    assert cfg.optim.lr == 3e-4  # untouched default
    assert cfg.train.grad_accum_steps() == 1


def test_extends_merges_tables_and_replaces_lists(tmp_path):
    (tmp_path / "base.toml").write_text(
        '[run]\nname = "base"\nseed = 3\n[train]\nmax_steps = 100\nseq_len = 64\n'
        '[[data.sources]]\nname = "a"\npaths = ["a/*.txt"]\n'
    )
    child = tmp_path / "sub" / "child.toml"
    child.parent.mkdir()
    child.write_text(
        'extends = "../base.toml"\n[train]\nmax_steps = 7\n'
        '[[data.sources]]\nname = "b"\npaths = ["b/*.txt"]\n'
    )
    cfg = load_config(child)
    assert cfg.train.max_steps == 7 and cfg.train.seq_len == 64  # merged
    assert cfg.run.seed == 3
    assert cfg.run.name == "child"  # a child's run name is its own
    assert [s.name for s in cfg.data.sources] == ["b"]  # lists are replaced


def test_overrides_are_parsed_to_the_field_type(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("")
    cfg = load_config(path, [
        "train.max_steps=42", "optim.lr=1e-3", "model.tie_embeddings=false", "run.name=abc",
        "precision.dtype=bf16", 'run.runs_root="x y"', "train.global_batch_tokens=4096",
        'data.sources=[{name = "n", paths = ["p/*.txt"]}]',
    ])
    assert cfg.train.max_steps == 42 and isinstance(cfg.train.max_steps, int)
    assert cfg.optim.lr == 1e-3
    assert cfg.model.tie_embeddings is False
    assert cfg.run.name == "abc" and cfg.run.runs_root == "x y"
    assert cfg.precision.dtype == "bf16"
    assert cfg.train.grad_accum_steps() == 4096 // (256 * 8)
    assert cfg.data.sources[0].paths == ["p/*.txt"]


def test_resolved_dump_is_a_recipe_that_reproduces_the_config(tmp_path):
    cfg = load_config(RECIPES / "tiny-shakespeare.toml", ["train.max_steps=3", "optim.lr=0.01"])
    dumped = tmp_path / "resolved.toml"
    dumped.write_text(dump_toml(cfg))
    assert "max_steps = 3" in dumped.read_text()
    assert load_config(dumped) == cfg
    tomllib.loads(dumped.read_text())  # valid TOML


def _error(path: Path, overrides=()) -> str:
    with pytest.raises(TrainbookError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_key_in_file_names_file_key_and_suggestion(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nmax_step = 5\n")
    assert _error(path) == f"{path}: train.max_step: unknown key 'max_step'; did you mean 'max_steps'?"


def test_unknown_section_and_nested_list_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[trian]\nmax_steps = 5\n")
    assert "trian: unknown key 'trian'; did you mean 'train'?" in _error(path)
    path.write_text('[[data.sources]]\nname = "a"\npaths = ["x"]\nweigth = 2\n')
    assert "data.sources[0].weigth: unknown key 'weigth'; did you mean 'weight'?" in _error(path)


def test_wrong_type_and_out_of_range_name_their_origin(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text('[train]\nseq_len = "long"\n')
    child = tmp_path / "child.toml"
    child.write_text('extends = "base.toml"\n[optim]\nlr = 0.1\n')
    message = _error(child)
    assert message.startswith(f"{base}: train.seq_len:"), message  # the parent file set it
    message = _error(tmp_path / "child.toml", ["train.seq_len=16", "optim.lr=-1"])
    assert message.startswith("command line: optim.lr: Input should be greater than 0"), message


def test_bad_overrides(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("")
    assert _error(path, ["train.max_stepz=3"]) == (
        "command line: train.max_stepz: unknown key 'max_stepz'; did you mean 'max_steps'?"
    )
    assert _error(path, ["train.max_steps=abc"]) == "command line: train.max_steps: cannot parse value 'abc'"
    assert "not of the form key.path=value" in _error(path, ["train.max_steps"])
    assert "Input should be 'fp32', 'bf16' or 'fp16'" in _error(path, ["precision.dtype=fp8"])


def test_extends_problems(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('extends = "b.toml"\n')
    b.write_text('extends = "a.toml"\n')
    assert "`extends` cycle" in _error(a)
    a.write_text('extends = "missing.toml"\n')
    assert "recipe file not found" in _error(a)
    a.write_text("[train\n")
    assert _error(a).startswith(f"{a}: not valid TOML")


def test_every_field_is_documented():
    for section_name, section in Config.model_fields.items():
        model = section.annotation
        if typing.get_origin(model) is list:  # [[expect]]: a list of tables
            assert section.description, f"{section_name} has no docstring"
            model = typing.get_args(model)[0]
        for name, field in model.model_fields.items():
            assert field.description, f"{section_name}.{name} has no docstring"


def test_a_config_saved_before_a_key_existed_compares_equal_with_its_default():
    """A run, checkpoint or baseline written before `[lora]`, `train.loss_on` and a source's
    `messages_field` existed reads back with their defaults (`with_defaults`), so `verify` and
    resume see the same recipe, not a changed one; a changed value still shows."""
    from trainbook.config import Config, dotted_keys, with_defaults

    today = Config.model_validate({"data": {"sources": [{"name": "a", "paths": ["x.txt"]}]}}).model_dump(
        mode="json", exclude_none=True)
    old = {k: v for k, v in today.items() if k != "lora"}
    old["train"] = {k: v for k, v in today["train"].items() if k != "loss_on"}
    old["data"] = {**today["data"], "sources": [{k: v for k, v in today["data"]["sources"][0].items()
                                                  if k not in ("messages_field", "prompt_field", "completion_field")}]}
    assert dotted_keys(with_defaults(old)) == dotted_keys(today)
    old["optim"] = {**today["optim"], "lr": 0.5}
    assert dotted_keys(with_defaults(old))["optim.lr"] == 0.5
