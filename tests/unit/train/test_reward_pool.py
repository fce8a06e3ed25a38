"""Reward functions in spawned worker processes (reward_pool.py): the scores are the ones
the trainer's own process computes, in order, whatever the split; a function that raises, a
worker that dies and a function that never answers are each one line naming the recipe key, and
the pool scores the next rollout with fresh workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainbook.errors import TrainbookError
from trainbook.reward_pool import RewardPool
from trainbook.scoring import call_scorer, load_scorer

FUNCTIONS = '''
import multiprocessing, os, threading


def length(prompts, completions, answer, **_):
    return [float(len(c)) + float(a) if len(c) != 3 else None for c, a in zip(completions, answer)]


def in_worker(prompts, completions, **_):
    return [float(multiprocessing.parent_process() is not None)] * len(completions)


def pid(prompts, completions, **_):
    return [float(os.getpid())] * len(completions)


def fails(prompts, completions, **_):
    raise ValueError("the judge is down")


def dies(prompts, completions, **_):
    os._exit(3)


def hangs(prompts, completions, **_):
    threading.Event().wait()
'''
OPTION = "grpo.reward[0].function"
COMPLETIONS = ["1", "22", "333", "4444", "55555", "6", "77", "888", "9999"]
PROMPTS = [f"prompt {i}" for i in range(len(COMPLETIONS))]
COLUMNS = {"answer": list(range(len(COMPLETIONS)))}


@pytest.fixture
def functions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the workers import `poolfns` from the working directory, as a run does
    (tmp_path / "poolfns.py").write_text(FUNCTIONS)
    pool = RewardPool(2)
    yield pool
    pool.close(kill=True)


def score(pool: RewardPool, name: str, timeout_s: float | None = None) -> list:
    return pool.score(f"poolfns:{name}", OPTION, PROMPTS, COMPLETIONS, COLUMNS, timeout_s)


def error(pool: RewardPool, name: str, timeout_s: float | None = None) -> str:
    with pytest.raises(TrainbookError) as e:
        score(pool, name, timeout_s)
    return str(e.value)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a killed child not yet reaped is a zombie: not running)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def test_a_pool_scores_in_its_workers_what_the_trainer_scores_itself(functions):
    here = call_scorer(load_scorer("poolfns:length"), "poolfns:length", PROMPTS, COMPLETIONS, COLUMNS,
                       allow_none=True)
    assert score(functions, "length") == here and here[2] is None  # in order, Nones kept
    assert score(functions, "in_worker") == [1.0] * len(COMPLETIONS)
    assert call_scorer(load_scorer("poolfns:in_worker"), "x", PROMPTS, COMPLETIONS, COLUMNS) == [0.0] * len(COMPLETIONS)
    assert len(set(score(functions, "pid"))) <= 2  # two workers shared the completions


def test_a_function_that_raises_dies_or_hangs_is_one_line_and_the_pool_goes_on(functions):
    assert error(functions, "fails") == f"{OPTION}: poolfns:fails raised ValueError: the judge is down"
    assert score(functions, "length")[0] == 1.0

    line = error(functions, "dies")
    assert line.startswith(f"{OPTION}: poolfns:dies: a reward worker died while scoring"), line
    assert score(functions, "length")[0] == 1.0  # fresh workers

    workers = set(score(functions, "pid"))
    line = error(functions, "hangs", timeout_s=0.5)
    assert line == (f"{OPTION}: poolfns:hangs did not answer 9 completions within grpo.reward_timeout_s = 0.5 s; "
                    "its workers were killed and fresh ones started"), line
    assert not any(alive(int(p)) for p in workers)  # the hung workers were killed, not left behind
    assert score(functions, "length")[0] == 1.0
    assert not set(score(functions, "pid")) & workers
