"""`trainbook eval`'s input, checked by the functions the command (and the RL issue) calls: a
prompt file's records, a scorer named by import path and what it returns. Each error is the one
line the CLI prints (its mapping to exit 2 is tested in tests/e2e/test_eval.py)."""

from __future__ import annotations

import json

import pytest

from trainbook.data.prompts import columns_of, read_prompts
from trainbook.scoring import call_scorer, load_scorer
from trainbook.errors import TrainbookError

USER = {"role": "user", "content": "What is 1+1?"}


def _error(fn, *args) -> str:
    with pytest.raises(TrainbookError) as e:
        fn(*args)
    return str(e.value)


def test_records_give_prompts_and_columns(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "1+1=", "answer": 2}, {"prompt": [USER], "answer": "2", "id": 7},
        {"messages": [{"role": "system", "content": "Be brief."}, USER], "answer": 2}]) + "\n\n")
    records = read_prompts(data)
    assert [r.prompt for r in records] == ["1+1=", [USER], [{"role": "system", "content": "Be brief."}, USER]]
    assert [r.line for r in records] == [1, 2, 3]
    assert columns_of(records, repeat=2) == {"answer": [2, 2, "2", "2", 2, 2], "id": [None, None, 7, 7, None, None]}


def test_bad_records_name_the_file_and_line(tmp_path):
    data = tmp_path / "p.jsonl"
    assert _error(read_prompts, tmp_path / "missing.jsonl") == f"--data: '{tmp_path / 'missing.jsonl'}': no such file"
    data.write_text('{"prompt": "a"}\n{"question": "b", "answer": 1}\n')
    assert _error(read_prompts, data) == (f"--data: '{data}' line 2: no field 'prompt' (a string or a list of "
                                          "messages) or 'messages'; the object has 'question', 'answer'")
    data.write_text(json.dumps({"messages": [USER, {"role": "assistant", "content": "2"}]}) + "\n")
    assert _error(read_prompts, data) == (f"--data: '{data}' line 1: field 'messages' ends with a message of role 'assistant'; "
                                          "a prompt ends with the user's turn (the completion is the assistant's answer)")
    data.write_text('{"prompt": "a"}\nnot json\n')
    assert _error(read_prompts, data).startswith(f"--data: '{data}' line 2: not valid JSON")


def test_scorers_are_imported_and_their_answers_checked(tmp_path, monkeypatch):
    assert _error(load_scorer, "trainbook.rewards") == (
        "--scorer: 'trainbook.rewards' is not module:function (e.g. trainbook.rewards:exact_answer)")
    assert _error(load_scorer, "no_such_module_here:f") == (
        "--scorer: cannot import 'no_such_module_here': ModuleNotFoundError: No module named 'no_such_module_here'")
    assert _error(load_scorer, "trainbook.rewards:nothing") == "--scorer: module 'trainbook.rewards' has no 'nothing'"
    assert _error(load_scorer, "trainbook.rewards:annotations") == (
        "--scorer: trainbook.rewards:annotations is not a function (its type: _Feature)")

    def fn(prompts, completions, answer, **_):
        return answer

    columns = {"answer": [1, 0.5]}
    assert call_scorer(fn, "m:fn", ["p", "q"], ["a", "b"], columns) == [1.0, 0.5]
    assert _error(call_scorer, fn, "m:fn", ["p"], ["a"], columns) == "--scorer: m:fn returned 2 scores for 1 completions"
    assert _error(call_scorer, fn, "m:fn", ["p", "q"], ["a", "b"], {"answer": [1, "x"]}) == (
        "--scorer: m:fn returned 'x' (a str) as score 1, not a finite number")
    assert _error(call_scorer, fn, "m:fn", ["p", "q"], ["a", "b"], {"answer": [float("nan"), 1]}) == (
        "--scorer: m:fn returned nan (a float) as score 0, not a finite number")
    assert _error(call_scorer, fn, "m:fn", ["p"], ["a"], {}) == (
        "--scorer: m:fn raised TypeError: test_scorers_are_imported_and_their_answers_checked.<locals>.fn() "
        "missing 1 required positional argument: 'answer'")
    # A reward may leave a completion unjudged (None), named by its recipe key; a scorer may not.
    assert _error(call_scorer, fn, "m:fn", ["p"], ["a"], {"answer": [None]}) == (
        "--scorer: m:fn returned None (a NoneType) as score 0, not a finite number")
    assert call_scorer(fn, "m:fn", ["p", "q"], ["a", "b"], {"answer": [None, 2]}, allow_none=True) == [None, 2.0]
    assert _error(lambda: call_scorer(fn, "m:fn", ["p"], ["a"], {"answer": ["x"]}, option="grpo.reward[0]",
                                      allow_none=True)) == (
        "grpo.reward[0]: m:fn returned 'x' (a str) as score 0, not a finite number or None")


def test_a_message_prompt_is_the_template_with_its_generation_prompt_and_ends_at_end_of_turn():
    from tests.conftest import REPO, qwen_tokenizer_files
    from trainbook.data.prompts import PromptEncoder
    from trainbook.config import TokenizerConfig
    from trainbook.data.chat import ChatTemplate
    from trainbook.data.tokenizer import build_tokenizer

    chatml = REPO / "tests" / "data" / "chatml.jinja"
    # EOS set apart from ChatML's end of turn, so each of the two stop tokens is seen.
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(qwen_tokenizer_files() / "tokenizer.json"),
                                          eos_token="<|endoftext|>"), lambda: [])
    encoder = PromptEncoder(tok, ChatTemplate(chatml.read_text(), str(chatml)))
    text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
           "<|im_start|>assistant\n"
    ids = encoder.ids([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids) == text and ids.count(tok.token_to_id("<|im_start|>")) == 3
    assert encoder.stop_ids == {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    assert encoder.ids("1+1=") == tok.encode("1+1=")  # a string prompt: as `trainbook sample` encodes it
    no_template = PromptEncoder(tok, None, "the run has no chat template (tokenizer.chat_template)")
    assert no_template.stop_ids == {tok.eos_id}
    assert _error(no_template.ids, [{"role": "user", "content": "Hi"}], "'p.jsonl' line 4") == (
        "--data: 'p.jsonl' line 4: a list of messages needs a chat template: the run has no chat template "
        "(tokenizer.chat_template)")
