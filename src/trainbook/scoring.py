"""Scorers and reward functions named by import path (`module:function`): found, called and
checked. `trainbook eval` scores completions with one; reinforcement learning rewards them with
several. The function is `fn(prompts, completions, **columns) -> list` (the columns: the prompt
records' other fields), answering one number per completion; a reward may answer None for a
completion it cannot judge (`allow_none`). Every error is one line naming `option` (`--scorer`,
or the recipe key that named the function).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable

from trainbook.errors import TrainbookError, one_line

Scorer = Callable[..., list]


def load_scorer(spec: str, option: str = "--scorer") -> Scorer:
    """The function `module:function` names (the working directory importable, as for
    `python -m`); a one-line error naming `option` when it cannot be had."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise TrainbookError(f"{spec!r} is not module:function (e.g. trainbook.rewards:exact_answer)",
                             where=option)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise TrainbookError(f"cannot import {module_name!r}: {type(e).__name__}: {one_line(e)}",
                             where=option) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise TrainbookError(f"module {module_name!r} has no {name!r}", where=option)
    if not callable(fn):
        raise TrainbookError(f"{spec} is not a function (its type: {type(fn).__name__})", where=option)
    return fn


def call_scorer(fn: Scorer, spec: str, prompts: list, completions: list[str], columns: dict[str, list], *,
                option: str = "--scorer", allow_none: bool = False) -> list[float | None]:
    """`fn(prompts, completions, **columns)` checked: one finite number per completion (or None,
    with `allow_none`)."""
    try:
        scores = fn(prompts, completions, **columns)
    except Exception as e:  # the user's function failed on the user's data
        raise TrainbookError(f"{spec} raised {type(e).__name__}: {one_line(e)}", where=option) from None
    try:
        scores = list(scores)
    except TypeError:
        raise TrainbookError(f"{spec} returned a {type(scores).__name__}, not a list of numbers",
                             where=option) from None
    if len(scores) != len(completions):
        raise TrainbookError(f"{spec} returned {len(scores)} scores for {len(completions)} completions",
                             where=option)
    out = []
    for i, s in enumerate(scores):
        if s is None and allow_none:
            out.append(None)
            continue
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise TrainbookError(f"{spec} returned {s!r} (a {type(s).__name__}) as score {i}, not a finite number"
                                 + (" or None" if allow_none else ""),
                                 where=option)
        out.append(float(s))
    return out
