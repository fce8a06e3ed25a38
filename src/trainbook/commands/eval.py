"""`trainbook eval RUN|CKPT --data FILE.jsonl --scorer module:function`: generate a completion for
each record's prompt, score every completion with the named function, archive it all.

The parts the reinforcement-learning issue reuses are functions of their own: `read_prompts` (the
records of a prompt file, checked line by line), `load_scorer` and `call_scorer` (a scorer named by
import path, its answer checked), `PromptEncoder` (a prompt as the model's ids, and the ids that
end a completion).

A record holds `prompt`: a string (encoded as it is, as `trainbook sample` encodes one) or a list
of messages (rendered with the run's chat template and its generation prompt, as training
rendered conversations); or `messages` ending with a user turn (the same as a message-list
prompt). Its other fields are the scorer's columns (`answer`, ...). Every check of the input runs
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
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainbook.atomic import atomic_write_json
from trainbook.data import Tokenizer
from trainbook.data.chat import ChatTemplate, check_messages, optional_template
from trainbook.errors import TrainbookError, one_line
from trainbook.model.sampler import LocalSampler, SamplingParams
from trainbook.runs import RunPaths
from trainbook.train.checkpoint_model import load_trained

EVALS = "evals"
EVAL_BATCH = 32  # prompts per batch of the sampler
PROMPT_FIELD, MESSAGES_FIELD = "prompt", "messages"


@dataclass(frozen=True)
class PromptRecord:
    prompt: str | list[dict]
    """As the record gives it: a string, or messages ending with a user turn."""
    columns: dict
    """The record's other fields."""
    line: int


def read_prompts(path: Path) -> list[PromptRecord]:
    """The records of JSONL file `path`, each with a prompt; a one-line error naming the file and
    line of the first that is not one."""
    path = Path(path)
    where = f"'{path}'"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TrainbookError(f"{where}: no such file", where="--data") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TrainbookError(f"{where}: cannot read: {one_line(e)}", where="--data") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where} line {number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise TrainbookError(f"{at}: not valid JSON: {one_line(e)}", where="--data") from None
        if not isinstance(record, dict):
            raise TrainbookError(f"{at}: expected a JSON object, got {type(record).__name__}", where="--data")
        records.append(_prompt_record(record, at, number))
    if not records:
        raise TrainbookError(f"{where}: no records", where="--data")
    return records


def _prompt_record(record: dict, at: str, number: int) -> PromptRecord:
    if PROMPT_FIELD in record:
        prompt = record[PROMPT_FIELD]
        if isinstance(prompt, str):
            if not prompt:
                raise TrainbookError(f"{at}: field 'prompt' is an empty string", where="--data")
        else:
            prompt = check_messages(prompt, f"{at}: field 'prompt'", "--data")
            _ends_with_user(prompt, f"{at}: field 'prompt'")
        key = PROMPT_FIELD
    elif MESSAGES_FIELD in record:
        prompt = check_messages(record[MESSAGES_FIELD], f"{at}: field 'messages'", "--data")
        _ends_with_user(prompt, f"{at}: field 'messages'")
        key = MESSAGES_FIELD
    else:
        names = ", ".join(f"'{k}'" for k in record) or "no fields"
        raise TrainbookError(f"{at}: no field 'prompt' (a string or a list of messages) or 'messages'; "
                             f"the object has {names}", where="--data")
    return PromptRecord(prompt, {k: v for k, v in record.items() if k != key}, number)


def _ends_with_user(messages: list[dict], what: str) -> None:
    if messages[-1]["role"] != "user":
        raise TrainbookError(f"{what} ends with a message of role '{messages[-1]['role']}'; a prompt ends with the "
                             "user's turn (the completion is the assistant's answer)", where="--data")


def columns_of(records: list[PromptRecord], repeat: int = 1) -> dict[str, list]:
    """Each field of the records (but the prompt) as a list, every record's value `repeat` times
    in a row (None where a record lacks the field): the scorer's keyword arguments."""
    names = list(dict.fromkeys(k for r in records for k in r.columns))
    return {name: [r.columns.get(name) for r in records for _ in range(repeat)] for name in names}


# ---- scorers -------------------------------------------------------------------------------

Scorer = Callable[..., list]


def load_scorer(spec: str) -> Scorer:
    """The function `module:function` names (the working directory importable, as for
    `python -m`); a one-line error naming `--scorer` when it cannot be had."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise TrainbookError(f"{spec!r} is not module:function (e.g. trainbook.rewards:exact_answer)",
                             where="--scorer")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise TrainbookError(f"cannot import {module_name!r}: {type(e).__name__}: {one_line(e)}",
                             where="--scorer") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise TrainbookError(f"module {module_name!r} has no {name!r}", where="--scorer")
    if not callable(fn):
        raise TrainbookError(f"{spec} is not a function (its type: {type(fn).__name__})", where="--scorer")
    return fn


def call_scorer(fn: Scorer, spec: str, prompts: list, completions: list[str], columns: dict[str, list]) -> list[float]:
    """`fn(prompts, completions, **columns)` checked: one finite number per completion."""
    try:
        scores = fn(prompts, completions, **columns)
    except Exception as e:  # the user's function failed on the user's data
        raise TrainbookError(f"{spec} raised {type(e).__name__}: {one_line(e)}", where="--scorer") from None
    try:
        scores = list(scores)
    except TypeError:
        raise TrainbookError(f"{spec} returned a {type(scores).__name__}, not a list of numbers",
                             where="--scorer") from None
    if len(scores) != len(completions):
        raise TrainbookError(f"{spec} returned {len(scores)} scores for {len(completions)} completions",
                             where="--scorer")
    out = []
    for i, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise TrainbookError(f"{spec} returned {s!r} (a {type(s).__name__}) as score {i}, not a finite number",
                                 where="--scorer")
        out.append(float(s))
    return out


# ---- prompts as ids ------------------------------------------------------------------------


class PromptEncoder:
    """A prompt as the run's model reads it: a string encoded as `trainbook sample` encodes one;
    messages rendered by the run's chat template with the generation prompt (the ids training
    saw before an assistant turn). `stop_ids`: the tokenizer's EOS and the template's end of turn."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, template_problem: str | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self._template_problem = template_problem
        self.stop_ids = {tokenizer.eos_id} | ({self._end_of_turn()} - {None} if template else set())

    @classmethod
    def of_run(cls, cfg, tokenizer: Tokenizer) -> PromptEncoder:
        try:
            found = optional_template(cfg.tokenizer)
        except TrainbookError as e:
            return cls(tokenizer, None, str(e))
        if found is None:
            return cls(tokenizer, None, "the run has no chat template (tokenizer.chat_template)")
        return cls(tokenizer, ChatTemplate(found[0], found[1], bos_token=tokenizer.bos_token,
                                           eos_token=tokenizer.eos_token))

    def ids(self, prompt: str | list[dict], where: str = "--data") -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if self.template is None:
            raise TrainbookError(f"{where}: a list of messages needs a chat template: {self._template_problem}",
                                 where="--data")
        text = self.template.render(prompt, add_generation_prompt=True)
        return self.tokenizer.encode_offsets(text, specials=True)[0]

    def _end_of_turn(self) -> int | None:
        """The special token the template writes right after an assistant message's text, if any
        (ChatML's <|im_end|>, Llama 3's <|eot_id|>)."""
        text = "Hello"
        try:  # a template that wants other turns, a tokenizer without offsets: no such token known
            rendered = self.template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}])
            after = rendered[rendered.rfind(text) + len(text):]
            ids = self.tokenizer.encode_offsets(after, specials=True)[0] if after.strip() else []
        except TrainbookError:
            return None
        if not ids:
            return None
        first = self.tokenizer.decode(ids[:1])
        return ids[0] if first in self.tokenizer.special_strings() else None


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
