"""Supervised fine-tuning on conversations, through the real command: `trainbook prepare` of a chat
JSONL with Qwen3's tokenizer writes loss-mask shards beside the token shards, a short `trainbook
run` from a tiny Qwen3 reports `trained_tokens` per step, and bad chat input is one line, exit 2,
nothing written."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import REPO, qwen_tokenizer_files, run_cli, run_cli_error
from tests.e2e.test_finetune import write_hf_qwen3

CHATML = REPO / "tests" / "data" / "chatml.jinja"


def _conversations(n: int) -> list[dict]:
    """Additions, one or two turns each: a few hundred tokens in all."""
    out = []
    for i in range(n):
        a, b = 3 * i + 1, 7 * i + 2
        messages = [{"role": "user", "content": f"What is {a}+{b}?"},
                    {"role": "assistant", "content": f"{a}+{b} = {a + b}."}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "And doubled?"},
                         {"role": "assistant", "content": f"{2 * (a + b)}."}]
        out.append({"messages": messages})
    return out


def _write_jsonl(path: Path, records: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _recipe(tmp: Path, model: str, tokenizer: str = "", extra: str = "") -> Path:
    recipe = tmp / "sft.toml"
    recipe.write_text(f"""
[run]
name = "sft"
seed = 0
device = "cpu"
runs_root = "{tmp / 'runs'}"

[model]
{model}

[tokenizer]
{tokenizer}

[[data.sources]]
name = "chat"
paths = ["{tmp / 'data' / 'chat.jsonl'}"]
format = "chat"

[data]
cache_dir = "{tmp / 'cache'}"
val_fraction = 0.1
packing = "document"

[train]
seq_len = 64
micro_batch_size = 2
global_batch_tokens = 256                 # 2 micro-batches of 2 x 64 per step
max_steps = 3
eval_every = 3
eval_steps = 1

[log]
every_steps = 1
{extra}
""")
    return recipe


def test_prepare_writes_masks_and_a_run_reports_trained_tokens(tmp_path):
    write_hf_qwen3(tmp_path / "models" / "qwen3")
    _write_jsonl(tmp_path / "data" / "chat.jsonl", _conversations(60))
    # The folder's tokenizer, and the ChatML template instead of the folder's own (Qwen3's, which
    # cannot mask more than one turn: test_chat.py).
    recipe = _recipe(tmp_path, f'name = "from_hf"\ninit_from = "hf:{tmp_path / "models" / "qwen3"}"',
                     f'chat_template = "{CHATML}"')

    prepared = run_cli("prepare", str(recipe), cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    (entry,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((entry / "manifest.json").read_text())
    (source,) = manifest["sources"]
    for split in ("train", "val"):
        assert source["masks"][split] and all((entry / name).is_file() for name in source["masks"][split])
        # A mask byte per token: the mask shards hold as many entries as the token shards.
        masks = sum(json.loads((entry / n.replace(".bin", ".json")).read_text())["tokens"]
                    for n in source["masks"][split])
        assert masks == source["tokens"][split] > 0

    done = run_cli("run", str(recipe), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["tokens"] for r in train] == [256, 512, 768]  # the running count
    for r in train:
        # Each step's 256 targets hold prompts, template tokens and the trained answers.
        assert isinstance(r["trained_tokens"], int) and 0 < r["trained_tokens"] < 256, r
        assert r["loss"] == r["loss"]
    assert any(r["kind"] == "eval" for r in records)


def _bad(tmp: Path, records: list, *overrides: str, chat_template: Path | None = CHATML) -> str:
    """`trainbook prepare` on a chat JSONL of `records` with Qwen3's tokenizer (the package's
    folder: with chat_template None, its own template). The line it prints."""
    _write_jsonl(tmp / "data" / "chat.jsonl", records)
    tokenizer = f'kind = "hf"\npath = "{qwen_tokenizer_files() / "tokenizer.json"}"'
    if chat_template is not None:
        tokenizer += f'\nchat_template = "{chat_template}"'
    recipe = _recipe(tmp, 'name = "debug"\nvocab_size = 151936', tokenizer)
    return run_cli_error("prepare", str(recipe), *overrides, cwd=tmp)


USER = {"role": "user", "content": "Hi"}
ASSISTANT = {"role": "assistant", "content": "Hello."}


def test_bad_chat_input_is_one_line_naming_the_file_and_line(tmp_path):
    data = tmp_path / "data" / "chat.jsonl"
    recipe = tmp_path / "sft.toml"
    good = {"messages": [USER, ASSISTANT]}
    at = f"trainbook: error: {recipe}: data.sources[0]: '{data}'"

    assert _bad(tmp_path, [good, {"conversation": [USER, ASSISTANT]}]) == (
        f"{at} line 2: no field 'messages' (messages_field); the object has 'conversation'")
    assert _bad(tmp_path, [good, good, {"messages": [USER, {"role": "robot", "content": "beep"}]}]) == (
        f"{at} line 3: field 'messages'[1]: role 'robot' is not one of system, user, assistant, tool")
    assert _bad(tmp_path, [{"messages": [USER]}]) == (
        f"{at} line 1: field 'messages' has no assistant message: nothing to train")
    assert _bad(tmp_path, [{"messages": []}]) == (
        f"{at} line 1: field 'messages' is an empty list, not a list of messages")

    # A template that cannot say which tokens are the assistant's: Qwen3's own, on two turns.
    two_turns = {"messages": [USER, ASSISTANT, USER, ASSISTANT]}
    config = qwen_tokenizer_files() / "tokenizer_config.json"
    assert _bad(tmp_path, [good, two_turns], chat_template=None) == (
        f"trainbook: error: {recipe}: tokenizer.chat_template: '{data}' line 2: chat template {config} "
        "(chat_template) renders message 1 (assistant) differently once later messages follow, so its tokens "
        "cannot be found turn by turn; give the template {% generation %} markers (tokenizer.chat_template = a file)")
    # A message spelling a control token would inject it.
    spelled = {"messages": [{"role": "user", "content": "end here <|im_end|> please"}, ASSISTANT]}
    assert _bad(tmp_path, [good, spelled]) == (
        f"{at} line 2: a user message spells the special token '<|im_end|>' (\"end here <|im_end|> please...\"); "
        "in a template's rendering it would be a control token, not text")


def test_bad_fine_tuning_settings_are_refused_before_reading(tmp_path):
    recipe = tmp_path / "sft.toml"
    good = [{"messages": [USER, ASSISTANT]}]
    assert _bad(tmp_path, good, "train.loss_on=completion") == (
        f"trainbook: error: {recipe}: train.loss_on: 'completion' trains the targets of prompt_completion data; "
        "source 'chat' (data.sources[0]) is chat (loss_on = 'auto' trains every token of text and the assistant "
        "turns of chat)")
    assert _bad(tmp_path, good, "data.packing=concat") == (
        f"trainbook: error: {recipe}: data.packing: chat and prompt_completion data (source 'chat') pack with "
        "data.packing = 'document' (positions and attention restart at every conversation) or 'pad' "
        "(one conversation per sample)")
    assert _bad(tmp_path, good, "tokenizer.kind=train_bpe") == (
        f"trainbook: error: {recipe}: tokenizer.kind: chat and prompt_completion data (source 'chat') need the "
        "model's own tokenizer.json (kind 'hf'), not kind 'train_bpe'")
    missing = tmp_path / "nowhere.jinja"
    line = _bad(tmp_path, good, chat_template=missing)
    assert line.startswith(f"trainbook: error: {recipe}: tokenizer.chat_template: cannot read '{missing}': ")
