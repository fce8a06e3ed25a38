"""The README's figures that come from committed files, compared with those files: the exit-code
table with errors.py, the exit status each provoked failure shows with the code of that failure,
the default recipe's numbers with its recipe, model and baseline, the perturbed-verify block's
baseline columns with the baseline. Nothing is run; output of real commands is compared by
tests/e2e/test_readme_output.py and the tests named in the README."""

from __future__ import annotations

import json
import re

from tests import readme
from tests.conftest import RECIPES
from trainbook import errors
from trainbook.config import load_config
from trainbook.model import registry
from trainbook.model import build_model, num_params

BASELINE = json.loads((RECIPES / "baselines" / "tiny-shakespeare.json").read_text())

# Each failure kind, by a word its row of the exit-code table must hold.
KINDS = {
    errors.TrainbookError: "bad input",
    errors.DiagnosedFailure: "out of memory",
    errors.HangFailure: "hang",
    errors.NonFiniteFailure: "non-finite",
    errors.RepeatedFailure: "restarts",
}

# The exit status shown after each `echo $?` of a playbook, in order: what failed there.
SHOWN = {
    "### Preflight: trainbook check": [1, errors.TrainbookError.exit_code],  # check's own 1 on a fail, then run refusing
    "### Hangs": [errors.HangFailure.exit_code],
    "### NaN and loss spikes": [errors.NonFiniteFailure.exit_code],
    "### Out of memory": [errors.DiagnosedFailure.exit_code],
}


def _doc_table(doc: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| (\S+) \| (.+) \|$", doc, flags=re.M) if m.group(1) != "code"}


def test_the_exit_code_table_is_the_one_errors_py_defines():
    rows = readme.table_after("Exit codes of `trainbook run`")
    assert rows[0] == ["code", "meaning"], rows[0]
    table = dict(rows[1:])
    defined = _doc_table(errors.__doc__)
    assert list(table) == list(defined), (list(table), list(defined))
    for kind, word in KINDS.items():
        code = str(kind.exit_code)
        assert word in table[code], f"README: exit code {code} is {kind.__name__} ({word}), the table says {table[code]!r}"
        assert word in defined[code], f"errors.py: exit code {code} is {kind.__name__}, its table says {defined[code]!r}"


def _shown_statuses(heading: str) -> list[int]:
    """The status printed after each `echo $?` in the section's transcripts."""
    shown = []
    for block in readme.blocks(heading):
        for command, printed in readme.transcript(block) if block.text.startswith("$ ") else []:
            if command.rstrip().endswith("echo $?"):
                shown.append(int(printed[-1]))
    return shown


def test_each_shown_exit_status_is_the_code_of_what_failed():
    for heading, codes in SHOWN.items():
        assert _shown_statuses(heading) == codes, heading
    # Every exit status the README shows is one of the above: a new one needs its line in SHOWN.
    assert readme.readme().count("echo $?") == sum(len(codes) for codes in SHOWN.values())


def test_the_default_recipe_paragraph_says_what_the_recipe_and_model_are():
    cfg = load_config(RECIPES / "tiny-shakespeare.toml")
    model = registry.resolve(cfg.model)
    text = " ".join(readme.section("## The embedded default, as it ran here")[0].split())
    said = re.search(r"a byte-level BPE of ([\d,]+) tokens .*?\(dim (\d+), (\d+) layers, (\d+) heads with (\d+) KV "
                     r"heads, tied embeddings: ([\d.]+)M parameters\), (\d+) steps of (\d+) x (\d+) tokens", text)
    assert said, text[:800]
    n = num_params(build_model(model, "meta", seed=0))
    assert said.groups() == (
        f"{cfg.tokenizer.vocab_size:,}", str(model.dim), str(model.n_layers), str(model.n_heads), str(model.n_kv_heads),
        f"{n / 1e6:.2f}", str(cfg.train.max_steps), str(cfg.train.global_batch_tokens // cfg.train.seq_len),
        str(cfg.train.seq_len),
    )
    assert model.tie_embeddings
    assert BASELINE["seeds"][0] == cfg.run.seed  # "its first seed (1337, the recipe's own)"


def test_the_val_loss_table_is_the_baselines_first_seed():
    """The table is `seed0.val_loss` of the committed baseline, rounded to 3 decimals, and the
    sentence after it is their ratio: regenerate both when the baseline is regenerated."""
    steps, losses = readme.table_after(f"The validation loss of its first seed ({BASELINE['seeds'][0]},")
    series = BASELINE["seed0"]["val_loss"]
    assert steps == ["step"] + [str(step) for step, _ in series]
    assert losses == ["val_loss"] + [f"{loss:.3f}" for _, loss in series]
    first, last = series[0][1], series[-1][1]
    assert f"({last:.3f} is {last / first:.2f} of the step-0 loss.)" in readme.readme()


def test_the_default_recipes_speed_is_the_baselines():
    """The speed the README gives is the baseline's (5 seeds, the machine the file names), and
    the minutes are its tokens over that speed; no other timing of the default recipe is shown."""
    rate, env = BASELINE["tokens_per_s"], BASELINE["environment"]
    minutes = BASELINE["tokens"] / rate["mean"] / 60
    sentence = (f"{len(BASELINE['seeds'])} seeds on {env['torch_threads']} threads of an {env['devices'][0]}) "
                f"trained at {rate['mean']:,.0f} tokens/s (sd {rate['sd']:,.0f} over the seeds), so the "
                f"{BASELINE['steps']} steps' {BASELINE['tokens']:,} tokens take {minutes:.1f} minutes")
    text, _ = readme.section("## The embedded default, as it ran here")
    assert sentence in " ".join(text.split()), sentence


def test_the_recipe_books_minutes_are_those_of_their_baselines():
    """'~N minutes' in the recipe book is the recipe's steps at its baseline's tokens/s (on the
    machine the baseline names), rounded: a figure the committed file gives, not a memory."""
    rows = {row[0].strip("`"): row for row in readme.table_after("| recipe | world | what | figures |")[1:]}
    for name in ("tiny-shakespeare", "classics-20m"):
        base = json.loads((RECIPES / "baselines" / f"{name}.json").read_text())
        train = base["config"]["train"]
        minutes = train["max_steps"] * train["global_batch_tokens"] / base["tokens_per_s"]["mean"] / 60
        assert f"~{minutes:.0f} minutes" in rows[name][2], (name, minutes, rows[name][2])


def test_the_perturbed_verify_block_shows_the_baselines_columns():
    """Of `trainbook verify ... optim.lr=2e-2 --steps 20`'s output, what comes from the baseline:
    the first seed's loss, the band, the sd the distance is counted in, the baseline's lr and
    peak memory. (The run's own numbers come from the run: tests/e2e/test_recipe_book.py runs it.)"""
    block = readme.block_after("A perturbed learning rate, as it printed here")
    text = block.text
    point = next(p for p in BASELINE["points"]["loss"] if p["step"] == 20)
    seed0 = dict(BASELINE["seed0"]["loss"])[20]
    row = re.search(r"^\s+20\s+loss\s+(\S+)\s+(\S+)\s+(\S+) \.\. (\S+)\s+out of band \(([+-][\d.]+) sd", text, flags=re.M)
    assert row, text
    this_run, shown_seed0, lo, hi, sd = row.groups()
    assert (shown_seed0, lo, hi) == (f"{seed0:.5f}", f"{point['lo']:.5f}", f"{point['hi']:.5f}")
    assert f"{(float(this_run) - (point['lo'] + point['hi']) / 2) / point['sd']:+.1f}" == sd
    assert f"seed {BASELINE['seeds'][0]}" in text
    assert f"judged within the band of {len(BASELINE['seeds'])} seeds (mean +- {BASELINE['k']:g} sd)" in text
    assert f"optim.lr = 0.02 (baseline {BASELINE['config']['optim']['lr']:g})" in text
    assert f"(baseline {BASELINE['mem_peak_bytes']['mean'] / 2**20:,.0f} MiB)" in text


def test_the_block_machinery_reads_transcripts_and_compares_in_order():
    """The machinery itself: a continued command is one command, its output follows it."""
    block = readme.Block("", "$ a \\\n  b\nout\n$ c\n", 1)
    assert readme.transcript(block) == [("a b", ["out"]), ("c", [])]
    assert readme.missing_lines(["x 1.5", "...", "y"], "x 2.25\nz\ny\n", mask=True) == []
    assert readme.missing_lines(["y", "x 1.5"], "x 2.25\ny\n", mask=True) == ["x 1.5"]  # order matters
    assert readme.missing_lines(['{"a": 1, ...'], '{"a": 1, "b": 2}') == []  # a cut line: its beginning
    assert readme.missing_lines(['{"a": 1, ...'], '{"a": 2, "b": 2}') == ['{"a": 1, ...']
    assert readme.missing_lines(["x 1.5"], "x 2.25") == ["x 1.5"]  # numbers count unless masked
    # A JSON line that shows its first keys or items: the printed line begins with them.
    assert readme.missing_lines(['{"a": 1, ...}', '"l": [1, ...]'], '{"a": 1, "b": 2}\n"l": [1, 2]') == []
    assert readme.missing_lines(['{"a": 1, ...}'], '{"b": 2, "a": 1}') == ['{"a": 1, ...}']
    assert readme.masked("run: runs/x/20261202-021153-85b56e (20 of 900)") == "run: runs/x/<run> (# of #)"
    assert readme.masked("----  -------") == readme.masked("----  ----------") == "---  ---"  # a table's rule


# Every fenced block of the README, by the start of its first line, and what it is:
#   ("input", what): commands, recipes or layouts to type or read, not output;
#   ("compared", test file[, marker]): output the test produces with the real command (or reads
#       from the committed file it comes from) and compares with the block, through
#       tests/readme.py; with `marker`, the test names the block by it (`block_after(marker)`);
#   ("printed", None, why): what one run here printed, checked by nothing, and why.
BLOCKS = {
    "make run ": ("input", "the two make targets"),
    "ROMEO:": ("printed", None, "needs the 900-step model; the README says so"),
    "trainbook run [RECIPE]": ("input", "the command line's synopsis"),
    "$ trainbook run recipes/mine.toml": ("compared", "tests/e2e/test_readme_output.py"),
    "verify recipes/tiny-shakespeare.toml optim.lr=2e-2": ("compared", "tests/unit/test_readme.py"),
    "runs/<run.name>/": ("input", "the run directory's layout"),
    "trainbook report runs/": ("input", "commands"),
    "trainbook run RECIPE monitor.prometheus_port": ("input", "commands"),
    "$ TRAINBOOK_FAULT=data.slow_batch@4+": ("compared", "tests/e2e/test_stragglers.py", "in which it spends the most more than"),
    '{"run": "tiny-shakespeare", "rank": 0, "rule": "stall"': ("input", "the alert JSON's format, an example"),
    "trainbook run --run-dir runs/": ("input", "commands"),
    "trainbook run RECIPE --nproc 4": ("input", "commands"),
    "$ trainbook run train.micro_batch_size=8 --nproc 2": ("compared", "tests/e2e/test_readme_output.py"),
    "[model]": ("input", "a recipe's section"),
    "[lora]": ("input", "a recipe's section"),
    "[[data.sources]]": ("input", "a recipe's sections"),
    "trainbook export RUN --format peft": ("input", "commands"),
    "trainbook eval runs/my-sft": ("input", "commands"),
    "trainbook run recipes/arith-sft.toml": ("input", "commands"),
    "trainbook run recipes/arith-grpo.toml": ("input", "commands"),
    "trainbook run recipes/arith-dpo.toml": ("input", "commands"),
    "# my-recipe.toml": ("compared", "tests/e2e/test_tutorial.py"),
    "trainbook check my-recipe.toml": ("compared", "tests/e2e/test_tutorial.py"),
    "trainbook bench data my-recipe.toml": ("compared", "tests/e2e/test_tutorial.py"),
    "TRAINBOOK_FAULT=train.after_step@5:r1:a0": ("compared", "tests/e2e/test_tutorial.py"),
    "$ TRAINBOOK_FAULT=check.slow_matmul": ("compared", "tests/e2e/test_readme_output.py"),  # its `run` line
    "$ trainbook doctor runs/slow": ("compared", "tests/e2e/test_doctor.py", "A slow input path"),
    "straggler: rank 1 waits for its data": ("compared", "tests/e2e/test_doctor.py", "Rank 1 of two slowed from step 4"),
    "died: the process was killed": ("compared", "tests/e2e/test_doctor.py", "A run killed by SIGKILL after step 3"),
    "trainbook run RECIPE --nproc 8 --max-restarts": ("input", "commands"),
    "restart 1: rank 1 (SIGKILL)": ("compared", "tests/e2e/test_tutorial.py", "Provoked by the tutorial's last command"),
    "trainbook: error: step 5 failed 3 times": ("compared", "tests/dist/test_elastic.py", "every attempt, `--max-restarts 2`):"),
    '{"kind": "restart", "step": 4': ("compared", "tests/dist/test_elastic.py", "with its worker after step 5:"),
    "$ trainbook run unit.toml --nproc 2 parallel.hang_timeout_s=4": ("compared", "tests/e2e/test_hang.py", "A rank stuck in data loading"),
    "trainbook: error: rank 0 waits in all_gather": ("compared", "tests/e2e/test_hang.py", "The same rank stopped whole"),
    "$ trainbook run unit.toml checkpoint.interval_steps=2": ("compared", "tests/e2e/test_triage.py", "A NaN put into block 1's output in step 4"),
    "triage: step 5: loss is nan": ("compared", "tests/e2e/test_triage.py", "whenever it is trained on (`TRAINBOOK_FAULT=data.nan_batch@5`"),
    "triage: step 18: loss": ("compared", "tests/e2e/test_triage.py", "(`TRAINBOOK_FAULT=data.random_batch@18`"),
    "$ trainbook run unit.toml train.eval_every=0 --run-dir runs/unit/oom-demo": ("compared", "tests/e2e/test_oom.py", "Provoked here by a block asking the allocator for a PiB"),
    '"measured": {"parameters"': ("compared", "tests/e2e/test_oom.py", "The breakdown, measured against plan"),
    "alert dead_expert at step": ("compared", "tests/e2e/test_moe.py", "routers were made to collapse from step 5"),
    "$ trainbook plan recipes/llama3-8b.toml train.seq_len=32768": (
        "compared", "tests/unit/parallel/test_plan.py", "it names the context-parallel degree that would on the"),
    "peak memory grew": ("compared", "tests/e2e/test_oom.py", "16 MiB kept per step by a block's forward"),
    "trainbook run ──► commands/resolve.py": ("input", "the architecture's picture"),
    "make test ": ("input", "development commands"),
}


def test_every_block_of_the_readme_is_input_or_output_that_a_test_names():
    """A new block of output needs its line above: compared by a test, or said to be what one
    run printed (and which test asserts it on its own run, or why none does)."""
    from tests.conftest import REPO

    found = {}
    for block in readme.blocks():
        keys = [k for k in BLOCKS if block.text.startswith(k)]
        assert len(keys) == 1, f"README.md:{block.line}: block {block.lines()[0][:60]!r} matches {keys} in BLOCKS"
        found[keys[0]] = block
    assert set(found) == set(BLOCKS), sorted(set(BLOCKS) - set(found))
    for key, (kind, *detail) in BLOCKS.items():
        if kind == "compared":
            source = (REPO / detail[0]).read_text()
            assert "from tests import readme" in source, (key, detail)
            if len(detail) > 1:  # the marker the test passes names this very block
                marker = detail[1]
                assert repr(marker)[1:-1] in source or marker in source, (key, detail)
                assert readme.block_after(marker).line == found[key].line, (key, marker)
        elif kind == "printed":
            assert detail[0] is None and detail[1], (key, detail)
