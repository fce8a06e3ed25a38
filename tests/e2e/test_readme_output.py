"""The README's bad-input transcripts, as the commands print them: every `$ trainbook ...` of those
blocks runs for real, in a folder holding `recipes/tiny-shakespeare.toml` and the
`recipes/mine.toml` the block names (the default recipe's data prepared once, shared with the
other tests), and the line the README shows under it is the line the command printed, exactly
(only the installed torch version may differ from the README's). Each exits 2 and writes
nothing. None of them trains, so the whole file takes a few seconds."""

from __future__ import annotations

import re
import shlex
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests import readme
from tests.conftest import RECIPES, run_cli_error

pytestmark = pytest.mark.slow

# The blocks that are bad-input transcripts, each named by the text just before it.
BLOCKS = ("Bad input never produces a traceback", "A fixed micro-batch that cannot split the global batch")
# The check playbook's transcript ends with `run` refused by the version lock: that step too.
CHECK = "Provoked here: a lock asking for another torch"


def _steps() -> list[tuple[str, list[str]]]:
    steps = [step for marker in BLOCKS for step in readme.transcript(readme.block_after(marker))]
    return steps + [step for step in readme.transcript(readme.block_after(CHECK)) if step[0].startswith("trainbook run ")]


def _torch_neutral(line: str) -> str:
    """The version-lock line names the installed torch; the README's names the one it ran with."""
    return re.sub(r"torch \S+ does not satisfy", "torch <installed> does not satisfy", line)


def test_the_readme_shows_the_lines_bad_input_prints(tmp_path, shakespeare_cache):
    (tmp_path / "recipes").mkdir()
    shutil.copy(RECIPES / "tiny-shakespeare.toml", tmp_path / "recipes")
    (tmp_path / "recipes" / "mine.toml").write_text('extends = "tiny-shakespeare.toml"\n\n[optim]\nweight_decai = 0.1\n')
    steps = _steps()
    assert len(steps) == 5, [command for command, _ in steps]

    def printed(command: str) -> str:
        args = shlex.split(command, comments=True)
        assert args[0] == "trainbook", command
        # The prepared data of the default recipe, so that the vocabulary check has its tokenizer.
        return run_cli_error(*args[1:], f"data.cache_dir={shakespeare_cache}", cwd=tmp_path)

    with ThreadPoolExecutor(2) as pool:  # each is a Python start-up and a config: two at a time
        lines = list(pool.map(printed, [command for command, _ in steps]))
    for (command, shown), line in zip(steps, lines):
        assert [_torch_neutral(s) for s in shown] == [_torch_neutral(line)], (
            f"README.md: `{command}` prints\n{line}\nwhere the README shows\n" + "\n".join(shown))
    assert torch.__version__ in lines[-1]  # the normalisation above replaced what it should
