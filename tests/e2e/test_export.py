"""`trainbook export --format hf` through the real command, for a run whose tokenizer puts BOS
first (`tokenizer.add_bos`): transformers' tokenizer loaded from the export gives the run's ids."""

import json

import pytest

from tests.conftest import run_cli
from trainbook.data import Tokenizer
from trainbook.data.tokenizer import hf_tokenizer_config

transformers = pytest.importorskip("transformers")

TEXTS = ["BERNARDO:\nWho's there?", "Nay, answer me: stand, and unfold yourself. 😀", ""]


def test_hf_export_of_an_add_bos_run_prepends_bos_in_transformers(recipe, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    done = run_cli("run", str(recipe), "train.max_steps=2", "tokenizer.bos_token=<s>",
                   "tokenizer.add_bos=true", "--run-dir", str(run_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    exported = run_cli("export", str(run_dir), "--format", "hf", "--out", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr

    ours = Tokenizer.load(run_dir / "tokenizer")
    assert ours.add_bos and ours.bos_token == "<s>"
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.bos_token_id == ours.bos_id
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ids[:1] == [ours.bos_id] and ids == ours.encode(text), text
    assert theirs(TEXTS)["input_ids"] == ours.encode_batch(TEXTS)
    assert theirs.decode(theirs("Who's there?")["input_ids"], skip_special_tokens=True) == "Who's there?"
    # What the exported folder says, read back as trainbook's fine-tuning import reads it.
    assert hf_tokenizer_config(out)["add_bos"] is True
    assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] == ours.bos_id
