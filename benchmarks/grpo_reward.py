"""The reward both sides of benchmarks/grpo_vs_trl.py score completions with (imported by name
from benchmarks/ on each side): the share of a completion's characters that are digits."""


def digits(prompts, completions, **_):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
