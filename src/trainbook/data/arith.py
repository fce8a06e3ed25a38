"""The data of `recipes/arith-sft.toml`, `arith-grpo.toml` and `arith-dpo.toml`: additions written as conversations,
from one seed.

`python -m trainbook.data.arith DIR` writes, byte for byte what the package ships in
`trainbook/recipes/arith/` (a test regenerates it and compares):

- `train.jsonl`: `{"messages": [{"role": "user", "content": "47+385"}, {"role": "assistant",
  "content": "432"}]}`, one addition a line;
- `prompts.jsonl`: the training additions as prompts with their `answer`, `{"messages": [{"role":
  "user", "content": "47+38"}], "answer": "85"}`, for reinforcement learning (`recipes/arith-grpo.toml`);
- `preference.jsonl`: the training additions as preference pairs, `{"prompt": [{"role": "user",
  "content": "47+38"}], "chosen": [{"role": "assistant", "content": "85"}], "rejected": [{"role":
  "assistant", "content": "84"}]}`, the rejected answer off by 1 or 10 either way (never below
  0), for preference optimisation (`recipes/arith-dpo.toml`);
- `heldout.jsonl`: `{"messages": [{"role": "user", "content": "18+6"}], "answer": "24"}`, additions
  that are not in the training file, for `trainbook eval --scorer trainbook.rewards:exact_answer`;
- `tokenizer.json`: one token a byte (a byte-level BPE without merges, so every digit is a token
  of its own) and `<|endoftext|>`, the end of each assistant turn (`template.jinja`).

Both operands are drawn uniformly from 0 .. 10**DIGITS - 1, as (a, b) pairs without repeats; the
held-out pairs are drawn first and never trained on.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from trainbook.data.tokenizer.tiktoken_bpe import byte_to_unicode

SEED = 20261205
DIGITS = 2
TRAIN = 9_500
HELDOUT = 500


def additions(seed: int = SEED, digits: int = DIGITS, train: int = TRAIN,
              heldout: int = HELDOUT) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training pairs, held-out pairs): distinct (a, b), disjoint, in the order drawn."""
    top = 10 ** digits
    if train + heldout > top * top:
        raise ValueError(f"{train + heldout} distinct pairs asked of {top * top}")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < train + heldout:
        pair = (rng.randrange(top), rng.randrange(top))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs[heldout:], pairs[:heldout]


def _user(a: int, b: int) -> dict:
    return {"role": "user", "content": f"{a}+{b}"}


def _assistant(answer: int) -> dict:
    return {"role": "assistant", "content": str(answer)}


def lines(seed: int = SEED, digits: int = DIGITS, train: int = TRAIN, heldout: int = HELDOUT) -> dict[str, str]:
    """File name -> its text."""
    fit, held = additions(seed, digits, train, heldout)
    train_lines = [json.dumps({"messages": [_user(a, b), _assistant(a + b)]}) for a, b in fit]
    prompt_lines = [json.dumps({"messages": [_user(a, b)], "answer": str(a + b)}) for a, b in fit]
    held_lines = [json.dumps({"messages": [_user(a, b)], "answer": str(a + b)}) for a, b in held]
    rng = random.Random(seed + 1)
    pair_lines = []
    for a, b in fit:
        wrong = a + b + rng.choice([d for d in (-10, -1, 1, 10) if a + b + d >= 0])
        pair_lines.append(json.dumps({"prompt": [_user(a, b)], "chosen": [_assistant(a + b)],
                                      "rejected": [_assistant(wrong)]}))
    return {"train.jsonl": "\n".join(train_lines) + "\n", "prompts.jsonl": "\n".join(prompt_lines) + "\n",
            "preference.jsonl": "\n".join(pair_lines) + "\n", "heldout.jsonl": "\n".join(held_lines) + "\n"}


EOS = "<|endoftext|>"


def tokenizer_json() -> str:
    """A byte-level tokenizer: `<|endoftext|>` is id 0, byte b is id 1 + b (written as ByteLevel
    writes it, GPT-2's stand-in character), no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {EOS: 0} | {char: 1 + b for b, char in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok.to_str(pretty=True) + "\n"


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m trainbook.data.arith DIR")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (lines() | {"tokenizer.json": tokenizer_json()}).items():
        (out / name).write_text(text, encoding="utf-8")
        print(f"{out / name}: {text.count(chr(10)):,} lines")


if __name__ == "__main__":
    main(sys.argv[1:])
