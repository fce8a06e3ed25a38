"""`trainbook eval RUN|CKPT --data FILE.jsonl --scorer module:function`: generate a completion for
each record's prompt, score every completion with the named function, archive it all.

What reinforcement learning reuses lives below the commands: the prompt file's records and a
prompt as ids (data/prompts.py), a scorer named by import path and its answer checked
(scoring.py). Every check of the input runs
before the first token is generated, and the scorer's answer is checked before anything is
written: bad input is one line, exit 2, and no file.

Completions come from the rollout engine (`model/sampler.py`: batches of prompts through the
run's model with a KV cache), the same one reinforcement learning samples with. Greedy at
temperature 0 (one completion, repeated for each sample); otherwise sampled from the whole
distribution, completion k of the file drawn with seed `seed + k` whatever batch it shares, so an
eval is repeatable and its samples differ. A prompt that leaves no room for `--max-new-tokens`
in the model's context is refused before any generation, naming its line.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
from pathlib import Path

import torch

from trainbook.atomic import atomic_write_json
from trainbook.data import Tokenizer
from trainbook.data.prompts import PromptEncoder, columns_of, read_prompts
from trainbook.errors import TrainbookError
from trainbook.model.sampler import LocalSampler, SamplingParams
from trainbook.runs import RunPaths
from trainbook.train.checkpoint_model import load_trained
from trainbook.scoring import call_scorer, load_scorer

EVALS = "evals"
EVAL_BATCH = 32  # prompts per batch of the sampler


# ---- the command ---------------------------------------------------------------------------


def eval_command(target: Path, data: Path, scorer: str, *, samples: int, temperature: float,
                 max_new_tokens: int, seed: int, as_json: bool) -> str:
    """Generate, score and archive (`RUN/evals/<time>.json`); the line to print, or with
    `as_json` the archived object. Everything the input can get wrong is checked before a token is
    generated (the file, the scorer, the checkpoint, every prompt's rendering), the scores before
    anything is written."""
    records = read_prompts(data)
    fn = load_scorer(scorer)
    trained = load_trained(target)
    if trained.cfg.run.threads:  # as the run trained: a small model generates faster on one thread
        torch.set_num_threads(trained.cfg.run.threads)
    tokenizer = Tokenizer.load(RunPaths.of(trained.run_dir).tokenizer)
    encoder = PromptEncoder.of_run(trained.cfg, tokenizer)
    prompt_ids = [encoder.ids(r.prompt, f"'{data}' line {r.line}") for r in records]
    room = trained.model.cfg.max_seq_len - max_new_tokens
    for r, ids in zip(records, prompt_ids):
        if len(ids) > room:
            raise TrainbookError(
                f"'{data}' line {r.line}: the prompt has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} "
                f"it needs {len(ids) + max_new_tokens} positions, more than the model's max_seq_len "
                f"{trained.model.cfg.max_seq_len}", where="--data")

    with _progress_bar(len(records) * samples) as progress:
        completions = _generate(trained.model, encoder, prompt_ids, samples, temperature, max_new_tokens, seed,
                                progress)
    prompts = [r.prompt for r in records for _ in range(samples)]
    scores = call_scorer(fn, scorer, prompts, completions, columns_of(records, samples))

    result = {
        "mean_score": sum(scores) / len(scores),
        "accuracy": sum(s >= 1 for s in scores) / len(scores),
        "n": len(scores),
        "settings": {
            "run": str(trained.run_dir.resolve()), "checkpoint": str(trained.checkpoint.resolve()), "step": trained.step,
            "data": str(Path(data).resolve()), "scorer": scorer, "samples": samples, "temperature": temperature,
            "max_new_tokens": max_new_tokens, "seed": seed,
        },
        "results": [
            {"record": i // samples, "line": records[i // samples].line, "sample": i % samples,
             "prompt": prompts[i], "completion": completions[i], "score": scores[i]}
            for i in range(len(scores))
        ],
    }
    path = _archive(trained.run_dir, result)
    if as_json:
        return json.dumps(result, indent=1, ensure_ascii=False)
    return (f"eval step {trained.step}: mean_score {result['mean_score']:.4f}, accuracy "
            f"{result['accuracy']:.1%} ({sum(s >= 1 for s in scores)}/{len(scores)} completions scored >= 1) "
            f"-> {path}")


def _generate(model, encoder: PromptEncoder, prompt_ids: list[list[int]], samples: int, temperature: float,
              max_new_tokens: int, seed: int, progress) -> list[str]:
    """`samples` completions per prompt, in order (as text, the stopping token left out). Greedy
    generates each prompt once."""
    tok = encoder.tokenizer
    draws = 1 if temperature == 0 else samples
    params = SamplingParams(max_new_tokens, temperature=temperature, stop_ids=frozenset(encoder.stop_ids - {None}))
    sampler = LocalSampler(model, batch_size=EVAL_BATCH, pad_id=tok.eos_id or 0)
    completions = sampler.generate([ids for ids in prompt_ids for _ in range(draws)],
                                   [seed + i * samples + j for i in range(len(prompt_ids)) for j in range(draws)],
                                   params, progress=lambda n: progress(n * samples // draws))
    texts = [tok.decode(c.ids[:-1] if c.stopped else c.ids) for c in completions]
    return [texts[i * draws + (j if draws > 1 else 0)] for i in range(len(prompt_ids)) for j in range(samples)]


@contextlib.contextmanager
def _progress_bar(total: int):
    """A bar on stderr while generating, where stderr is a terminal (as `run` draws one on its
    console); elsewhere nothing, so a log or a failed eval's error stays one line."""
    if not sys.stderr.isatty():
        yield lambda done: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=False)
    task = bar.add_task("eval", total=total)
    with bar:
        yield lambda done: bar.update(task, completed=done)


def _archive(run_dir: Path, result: dict) -> Path:
    """`evals/<time>.json` in the run directory, written atomically (a second eval in the same
    second gets `-2`, ...)."""
    folder = Path(run_dir) / EVALS
    folder.mkdir(exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = folder / f"{stamp}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{stamp}-{n}.json"
    atomic_write_json(path, result)
    return path
