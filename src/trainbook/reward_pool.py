"""Reward functions in worker processes (`grpo.reward_workers`): for functions slow enough that
scoring a rollout in the trainer's own process would leave the accelerator idle (a verifier, a
sandboxed test run), and for ones that may crash or hang.

Each call splits the rollout's completions (with their prompts and columns) into one contiguous
chunk per worker; a worker imports the function by its path (cached) and answers its chunk's
scores, checked as in-process scores are (scoring.py). The answer is the chunks' scores in
order, so it equals the in-process answer for any function that scores each completion on its
own. What goes wrong becomes one `TrainbookError` naming the function's recipe key, which the
objective records as an incident of the rollout:
- the function raises or answers badly: its message, as in-process;
- a worker dies (a segfault, `os._exit`): the pool is replaced by a fresh one;
- no answer within `timeout_s`: the workers are killed and a fresh pool started.

Workers are spawned (never forked from a process holding torch's threads and a process group)
and started before the first rollout, so a timeout never counts their start-up.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from concurrent.futures.process import BrokenProcessPool

from trainbook.errors import TrainbookError
from trainbook.scoring import Scorer, call_scorer, load_scorer

_loaded: dict[str, Scorer] = {}  # in a worker: each function imported once


def _score_chunk(spec: str, option: str, prompts: list, completions: list[str],
                 columns: dict[str, list]) -> tuple[bool, list | str]:
    """In a worker: (True, scores) or (False, the one-line error)."""
    try:
        if spec not in _loaded:
            _loaded[spec] = load_scorer(spec, option)
        return True, call_scorer(_loaded[spec], spec, prompts, completions, columns, option=option, allow_none=True)
    except TrainbookError as e:
        return False, e.message


def _ready() -> bool:
    return True


class RewardPool:
    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.workers = workers
        self._executor: cf.ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Spawn the workers and wait until each has started (no timeout: start-up is not scoring)."""
        if self._executor is not None:
            return
        self._executor = cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        for f in [self._executor.submit(_ready) for _ in range(self.workers)]:
            f.result()

    def score(self, spec: str, option: str, prompts: list, completions: list[str], columns: dict[str, list],
              timeout_s: float | None = None) -> list[float | None]:
        """The scores of `completions`, in order, from the workers; a `TrainbookError` naming
        `option` when the function fails, a worker dies or no answer comes within `timeout_s`."""
        self.start()
        n = len(completions)
        bounds = [(n * i // self.workers, n * (i + 1) // self.workers) for i in range(self.workers)]
        futures = [self._executor.submit(_score_chunk, spec, option, prompts[a:b], completions[a:b],
                                         {k: v[a:b] for k, v in columns.items()})
                   for a, b in bounds if b > a]
        try:
            answers = [f.result() for f in cf.as_completed(futures, timeout=timeout_s)]
        except cf.TimeoutError:
            self.close(kill=True)
            raise TrainbookError(f"{spec} did not answer {n} completions within grpo.reward_timeout_s = {timeout_s:g} s; "
                                 "its workers were killed and fresh ones started", where=option) from None
        except BrokenProcessPool:
            self.close(kill=True)
            raise TrainbookError(f"{spec}: a reward worker died while scoring (a crash in the function or "
                                 "what it calls); fresh workers were started", where=option) from None
        errors = [msg for ok, msg in answers if not ok]
        if errors:
            raise TrainbookError(errors[0], where=option)
        return [s for f in futures for s in f.result()[1]]

    def close(self, kill: bool = False) -> None:
        """Stop the workers: let them finish (the run's end) or kill them (a hung or broken pool)."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        if kill:  # no public way to kill a ProcessPoolExecutor's workers before Python 3.14
            workers = list((getattr(executor, "_processes", None) or {}).values())
            for p in workers:
                p.kill()
            for p in workers:  # reaped: nothing of them is left behind
                p.join()
        executor.shutdown(wait=not kill, cancel_futures=True)
