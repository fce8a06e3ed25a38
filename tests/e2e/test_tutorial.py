"""The README's tutorial "Your data, your model", run as written: its TOML blocks become the files
they name, its bash blocks run line by line with the real `trainbook` command, in a folder that
holds what a reader brings (a Hugging Face Llama folder, a JSONL of text)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    _assert_baseline_is_its_runs(tmp_path / "baselines" / "mine.json", tmp_path / "runs" / "mine")
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


def _assert_baseline_is_its_runs(path: Path, runs_root: Path) -> None:
    """What `baseline --seeds 2 --steps 10` of the tutorial's recipe wrote: its seeds' runs, the first
    seed's series exactly as its run logged it, each point's band, and the environment it was made
    in (the verify after it, judged bit for bit, is the check that holds on any machine: the
    committed baseline of the default recipe is bit for bit only on the machine that made it)."""
    data = json.loads(path.read_text())
    assert data["seeds"] == [0, 1] and data["k"] == 3.0 and data["steps"] == 10
    runs = sorted(p for p in runs_root.glob("baseline-*/seed-*") if p.is_dir())
    assert [r.name for r in runs] == ["seed-0", "seed-1"]
    first = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert data["seed0"]["loss"] == [[m["step"], m["loss"]] for m in first if m["kind"] == "train"]
    assert data["seed0"]["val_loss"] == [[m["step"], m["val_loss"]] for m in first if m["kind"] == "eval"]
    for p in data["points"]["loss"]:
        assert p["lo"] <= p["mean"] <= p["hi"] and len(p["values"]) == 2
        assert p["hi"] - p["mean"] == pytest.approx(max(3 * p["sd"], 0.005 * abs(p["mean"])))
    assert [p["step"] for p in data["points"]["val_loss"]] == [0, 5, 10]
    assert data["environment"]["torch"].startswith("2.13") and "trainbook" not in data["environment"]["packages"]
