"""The README's tutorial "Your data, your model", run as written: its TOML blocks become the files
they name, its bash blocks run line by line with the real `trainbook` command, in a folder that
holds what a reader brings (a Hugging Face Llama folder, a JSONL of text)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import readme
from tests.conftest import PLAY, write_hf_llama

SECTION = "## Your data, your model"


def tutorial_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the tutorial section, in order."""
    return [(block.lang, block.text) for block in readme.blocks(SECTION)]


def test_the_tutorial_blocks_run_as_written(tmp_path):
    blocks = tutorial_blocks()
    assert [lang for lang, _ in blocks].count("bash") >= 3 and any(lang == "toml" for lang, _ in blocks)
    write_hf_llama(tmp_path / "models" / "my-llama")
    (tmp_path / "data").mkdir()
    lines = [json.dumps({"text": f"SCENE {i}.\n" + PLAY * (1 + i % 4)}) for i in range(300)]
    (tmp_path / "data" / "mine.jsonl").write_text("\n".join(lines) + "\n")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    ran = []
    for lang, text in blocks:
        if lang == "toml":
            first, _, body = text.partition("\n")
            name = first.removeprefix("# ").split(" ")[0]
            mode = "a" if "(append)" in first else "w"
            with open(tmp_path / name, mode, encoding="utf-8") as f:
                f.write(body if mode == "w" else "\n" + body)
            continue
        assert lang == "bash", lang
        for command in (line for line in text.splitlines() if line.strip() and not line.startswith("#")):
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, f"README tutorial: `{command}` exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            ran.append((command, done.stdout + done.stderr))
    out = dict(ran)
    # What each step promises, seen in what it printed.
    verify = next(v for k, v in out.items() if k.startswith("trainbook verify"))
    assert "judged bit for bit" in verify and "PASS" in verify, verify
    assert (tmp_path / "baselines" / "mine.json").is_file()
    plan = next(v for k, v in out.items() if k.startswith("trainbook plan"))
    assert "on 8 rank(s)" in plan and "FITS" in plan, plan
    assert (tmp_path / "runs" / "two-ranks" / "report.html").is_file()
    restart = next(v for k, v in out.items() if k.startswith("grep"))
    event = json.loads(restart.splitlines()[0])
    assert event["failed"][0]["rank"] == 1 and event["failed"][0]["signal"] == "SIGKILL", event
    assert event["resumed_step"] == 4, event
    # The README's restart block (under Elastic restarts) is what this run printed and its grep found.
    resilient = next(v for k, v in out.items() if k.startswith("TRAINBOOK_FAULT=train.after_step@5:r1:a0 "))
    readme.assert_printed("Provoked by the tutorial's last command", resilient + readme.events(restart), mask=True)
