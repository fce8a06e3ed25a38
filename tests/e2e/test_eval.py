"""`trainbook eval` and `model.init_from = "run:PATH"` on one tiny LoRA chat run (a Qwen3 of ~5M
parameters, 3 steps): the archived evals/<time>.json holds what was printed and the scores a
scorer gives its completions again; greedy eval is repeatable; a run started from the LoRA run
begins from its weights with the adapters merged, bit for bit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, run_cli_error
from tests.e2e.test_finetune import write_hf_qwen3
from tests.e2e.test_sft import CHATML, _conversations, _recipe, _write_jsonl

ALPHA, RANK = 8.0, 4

SCORER = '''
def lengths(prompts, completions, answer, tag, **_):
    assert len(prompts) == len(completions) == len(answer) == len(tag)
    return [(len(c) % 3) / 2 for c in completions]
'''

PROMPTS = [
    {"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": 5, "tag": "a"},
    {"messages": [{"role": "user", "content": "What is 10+4?"}], "answer": "14", "tag": "b"},
    {"prompt": "7+1=", "answer": 8, "tag": "c"},
]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A 3-step LoRA run on chat data (one thread: generation of a tiny model is faster so), its
    checkpoint at step 3. Returns the test folder; the run is `run/`."""
    tmp = tmp_path_factory.mktemp("eval")
    write_hf_qwen3(tmp / "models" / "qwen3")
    _write_jsonl(tmp / "data" / "chat.jsonl", _conversations(60))
    _write_jsonl(tmp / "prompts.jsonl", PROMPTS)
    (tmp / "myscorer.py").write_text(SCORER)
    # A large learning rate from step 1, so the adapters' B is far from zero after 3 steps.
    extra = (f"\n[lora]\nrank = {RANK}\nalpha = {ALPHA}\n\n[optim]\nlr = 0.01\n\n[schedule]\nwarmup_steps = 0\n")
    recipe = _recipe(tmp, f'name = "from_hf"\ninit_from = "hf:{tmp / "models" / "qwen3"}"',
                     f'chat_template = "{CHATML}"', extra)
    done = run_cli("run", str(recipe), "run.threads=1", "--run-dir", str(tmp / "run"), cwd=tmp)
    assert done.returncode == 0, done.stderr
    return tmp


def _hand_exact(completion: str, answer) -> float:
    numbers = re.findall(r"\d+", completion)
    return 1.0 if numbers and numbers[-1] == str(answer) else 0.0


def test_eval_archives_what_it_prints_and_greedy_repeats(lora_run):
    from trainbook.commands.eval import eval_command

    run = lora_run / "run"
    done = run_cli("eval", str(run), "--data", "prompts.jsonl", "--scorer", "myscorer:lengths", "--samples", "2",
                   "--temperature", "1", "--max-new-tokens", "6", "--seed", "5", "--json", cwd=lora_run)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    (archived,) = (run / "evals").iterdir()
    assert json.loads(archived.read_text()) == printed
    assert printed["n"] == 6 and len(printed["results"]) == 6
    assert printed["settings"] == {
        "run": str(run), "checkpoint": str(run / "checkpoints" / "step-3"), "step": 3,
        "data": str(lora_run / "prompts.jsonl"), "scorer": "myscorer:lengths", "samples": 2, "temperature": 1.0,
        "max_new_tokens": 6, "seed": 5,
    }
    results = printed["results"]
    assert [(r["record"], r["sample"], r["line"]) for r in results] == [(i, j, i + 1) for i in range(3) for j in range(2)]
    assert results[4]["prompt"] == "7+1=" and results[2]["prompt"] == PROMPTS[1]["messages"]
    # The scorer again, by hand, over the archived completions; the figures from the scores.
    scores = [(len(r["completion"]) % 3) / 2 for r in results]
    assert [r["score"] for r in results] == scores
    assert printed["mean_score"] == sum(scores) / 6
    assert printed["accuracy"] == sum(s >= 1 for s in scores) / 6

    # Greedy (the default) twice, in this process: the same completions; the built-in scorer.
    threads = torch.get_num_threads()  # eval takes the run's run.threads = 1
    try:
        lines = [eval_command(run, lora_run / "prompts.jsonl", "trainbook.rewards:exact_answer", samples=2,
                              temperature=0.0, max_new_tokens=6, seed=0, as_json=False) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    files = sorted(set((run / "evals").iterdir()) - {archived})
    assert len(files) == 2 and all(str(f) in line for f, line in zip(files, lines, strict=True))
    first, second = (json.loads(f.read_text()) for f in files)
    assert [r["completion"] for r in first["results"]] == [r["completion"] for r in second["results"]]
    completions = [r["completion"] for r in first["results"]]
    assert completions[0::2] == completions[1::2]  # greedy: each prompt's samples are one
    answers = [p["answer"] for p in PROMPTS for _ in range(2)]
    assert [r["score"] for r in first["results"]] == [_hand_exact(c, a) for c, a in zip(completions, answers)]
    assert lines[0].startswith(f"eval step 3: mean_score {first['mean_score']:.4f}, accuracy {first['accuracy']:.1%}")


def test_a_run_from_a_lora_run_starts_from_its_merged_weights(lora_run):
    from trainbook.train.checkpoint_model import load_trained

    source, run = lora_run / "run", lora_run / "from-run"
    # Full fine-tuning from the LoRA run for one step at a learning rate of 1e-30: no fp32 weight
    # of this model's size moves, so the step-1 checkpoint holds the weights it started from.
    done = run_cli("run", str(lora_run / "sft.toml"), f"model.init_from=run:{source}", "lora.rank=0",
                   "optim.lr=1e-30", "train.max_steps=1", "train.eval_every=0", "run.threads=1",
                   "--run-dir", str(run), cwd=lora_run)
    assert done.returncode == 0, done.stderr

    adapted = load_trained(source).model.state_dict()  # the checkpoint as saved: base and adapters
    started = load_trained(run).model.state_dict()
    assert not any("lora" in k for k in started)
    changed = 0
    for key, value in started.items():
        expected = adapted[key]
        prefix = key.removesuffix(".weight")
        if f"{prefix}.lora_a.weight" in adapted:  # W + alpha/r B A, in fp32
            a, b = adapted[f"{prefix}.lora_a.weight"], adapted[f"{prefix}.lora_b.weight"]
            expected = (expected.float() + (ALPHA / RANK) * (b.float() @ a.float())).to(expected.dtype)
            changed += not torch.equal(expected, adapted[key])
        assert torch.equal(value, expected), key
    assert changed > 0  # the adapters moved the weights they sit on
    resolved = (run / "config.resolved.toml").read_text()
    assert f'init_from = "run:{source}"' in resolved and "dim = 32" in resolved


def test_a_prompt_without_room_for_max_new_tokens_is_one_line(lora_run):
    """Checked for every record before generation: the line names the record, nothing is written."""
    line = run_cli_error("eval", str(lora_run / "run"), "--data", "prompts.jsonl", "--scorer",
                         "trainbook.rewards:exact_answer", "--max-new-tokens", "500", cwd=lora_run)
    assert re.fullmatch(r"trainbook: error: --data: 'prompts.jsonl' line 1: the prompt has (\d+) tokens; with "
                        r"--max-new-tokens 500 it needs (\d+) positions, more than the model's max_seq_len (\d+)", line)


def test_no_checkpoint_is_one_line_for_eval_and_init_from_run(tmp_path):
    """A run directory without a valid checkpoint: `eval` and a run starting from it each say so
    in one line naming what to fix, exit 2, nothing written (the other bad input of eval is
    tests/unit/commands/test_eval_input.py)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.resolved.toml").write_text("")
    _write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    assert run_cli_error("eval", str(empty), "--data", "prompts.jsonl", "--scorer", "trainbook.rewards:exact_answer",
                         cwd=tmp_path) == f"trainbook: error: {empty}: run has no valid checkpoint yet"
    recipe = _recipe(tmp_path, 'name = "from_hf"', f'chat_template = "{CHATML}"')
    assert run_cli_error("run", str(recipe), f"model.init_from=run:{empty}", cwd=tmp_path) == (
        f"trainbook: error: {recipe}: model.init_from: 'run:{empty}': run has no valid checkpoint yet")
