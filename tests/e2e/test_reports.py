"""`trainbook report`, `compare` and `runs` on real run directories made by the real CLI.

One small archive is trained once for the module: two finished runs that differ in `optim.lr`,
one that fails with a Python error, one killed by SIGKILL, one stopped by SIGTERM (and seen
running before that). The pages are opened in a real headless Chromium (Debian's `chromium`,
driven by Playwright): no network request, no console error, every chart drawn.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import prepared_recipe, run_cli, run_cli_error

STEPS = 6
COMMON = ("train.max_steps=6", "log.every_steps=2", "run.threads=1", "checkpoint.interval_steps=3")


def _train(recipe: Path, run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainbook", "run", str(recipe), *COMMON, *overrides, "--run-dir", str(run_dir)],
        cwd=recipe.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


@pytest.fixture(scope="module")
def archive(tmp_path_factory, debug_data):
    tmp = tmp_path_factory.mktemp("archive")
    recipe = prepared_recipe(tmp, debug_data)  # the data once, before the runs share it
    root = tmp / "runs"
    runs = {name: root / "unit" / name for name in ("lr-high", "lr-low", "failed", "died", "stopped")}
    procs = {
        "lr-high": _train(recipe, runs["lr-high"], "optim.lr=0.004"),
        "lr-low": _train(recipe, runs["lr-low"], "optim.lr=0.001"),
        "failed": _train(recipe, runs["failed"], "monitor.layer_stats_every=1",
                         env={"TRAINBOOK_FAULT": "train.after_step@2",
                                                        "TRAINBOOK_FAULT_ACTION": "raise"}),
        "died": _train(recipe, runs["died"], env={"TRAINBOOK_FAULT": "train.after_step@2"}),
    }
    results = {name: (p.wait(timeout=300), p.stderr.read()) for name, p in procs.items()}
    for p in procs.values():
        p.stdout.close(), p.stderr.close()
    assert results["lr-high"][0] == 0 and results["lr-low"][0] == 0, results
    assert results["failed"][0] == 1 and "fault injected" in results["failed"][1], results["failed"]
    assert results["died"][0] == -signal.SIGKILL, results["died"]

    # A long run: listed as running while it trains, then stopped by SIGTERM. Eager: left to auto, a
    # CPU peak probe slowed by a busy machine can make 100000 steps look worth compiling (a minute).
    proc = _train(recipe, runs["stopped"], "train.max_steps=100000", "log.every_steps=1", "train.eval_every=0",
                  "train.compile=false")
    metrics = runs["stopped"] / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)
    while_running = run_cli("runs", "--root", str(root), "--where", "train.max_steps=100000", cwd=tmp)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    return tmp, root, runs, while_running


def _rows(table: str) -> dict[str, list[str]]:
    """`trainbook runs` output -> run (relative path) -> its cells."""
    lines = table.splitlines()
    header = lines[0].split()
    run_col = header.index("run")
    return {line.split()[run_col]: line.split() for line in lines[2:]}


# ---- runs ---------------------------------------------------------------------------------------


def test_runs_lists_every_run_with_its_status(archive):
    tmp, root, runs, while_running = archive
    assert while_running.returncode == 0, while_running.stderr
    running = _rows(while_running.stdout)
    assert list(running) == ["unit/stopped"] and running["unit/stopped"][4] == "running"

    done = run_cli("runs", "--root", str(root), cwd=tmp)
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout)
    assert set(rows) == {f"unit/{name}" for name in runs}
    status = {run: cells[4] for run, cells in rows.items()}
    assert status == {"unit/lr-high": "finished", "unit/lr-low": "finished", "unit/failed": "failed",
                      "unit/died": "died", "unit/stopped": "stopped"}
    assert rows["unit/lr-high"][5] == f"{STEPS}/{STEPS}" and rows["unit/failed"][5] == f"2/{STEPS}"
    assert "RuntimeError: fault injected" in done.stdout  # the failed run says why
    final = [json.loads(line) for line in (runs["lr-high"] / "metrics.jsonl").read_text().splitlines()]
    assert rows["unit/lr-high"][6] == f"{[r for r in final if r['kind'] == 'train'][-1]['loss']:.4g}"


def test_runs_where_and_sort(archive):
    tmp, root, _, _ = archive
    only = run_cli("runs", "--root", str(root), "--where", "optim.lr=4e-3", cwd=tmp)
    assert only.returncode == 0 and list(_rows(only.stdout)) == ["unit/lr-high"], only.stdout + only.stderr
    both = run_cli("runs", "--root", str(root), "--where", "optim.lr=0.001", "--where", "run.name=unit", cwd=tmp)
    assert list(_rows(both.stdout)) == ["unit/lr-low"]
    none = run_cli("runs", "--root", str(root), "--where", "optim.lr=0.5", cwd=tmp)
    assert none.returncode == 0 and none.stdout.startswith("no runs under")

    by_loss = run_cli("runs", "--root", str(root), "--sort", "loss", cwd=tmp)
    rows = _rows(by_loss.stdout)
    losses = [float(cells[6]) for cells in rows.values() if cells[6] != "-"]
    assert losses == sorted(losses) and len(losses) == 5  # lowest first
    by_steps = run_cli("runs", "--root", str(root), "--sort", "steps", cwd=tmp)
    steps = [int(cells[5].split("/")[0]) for cells in _rows(by_steps.stdout).values()]
    assert steps == sorted(steps, reverse=True) and len(steps) == 5  # most steps first
    # The default root is runs/ in the working directory.
    here = run_cli("runs", "--sort", "name", cwd=root.parent)
    assert set(_rows(here.stdout)) == set(rows)


# ---- compare ------------------------------------------------------------------------------------


def test_compare_names_the_differing_key_and_the_run_ahead(archive):
    tmp, _, runs, _ = archive
    out = tmp / "cmp.html"
    done = run_cli("compare", str(runs["lr-high"]), str(runs["lr-low"]), "--out", str(out), cwd=tmp)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    diff = [line.split() for line in lines if line.startswith("optim.lr")]
    assert diff == [["optim.lr", "0.004", "0.001"]]
    assert not any(line.startswith(("run.name", "train.", "model.")) for line in lines)
    # Who is ahead, checked against the metrics files themselves.
    loss = {}
    for name in ("lr-high", "lr-low"):
        records = [json.loads(x) for x in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        loss[name] = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}[STEPS]
    best, other = sorted(loss, key=loss.get)
    row = next(line for line in lines if line.startswith("loss "))
    assert f"step {STEPS}" in row and f"{best} by {loss[other] - loss[best]:.4g}" in row, row
    assert any(line.startswith("val loss") for line in lines) and any(line.startswith("tokens/s") for line in lines)
    assert lines[-1] == f"html: {out}" and out.is_file()
    default = run_cli("compare", str(runs["lr-high"]), str(runs["lr-low"]), cwd=tmp)
    assert default.returncode == 0 and (tmp / "compare.html").is_file()


# ---- bad input ----------------------------------------------------------------------------------


def test_bad_input_is_one_line_and_writes_nothing(archive, tmp_path):
    tmp, root, runs, _ = archive
    cwd = tmp_path
    watch = (root,)
    plain = tmp_path / "plain"
    plain.mkdir()
    line = run_cli_error("report", str(plain), cwd=cwd, watch=watch)
    assert f"{plain}: not a run directory" in line
    line = run_cli_error("report", str(tmp / "nowhere"), cwd=cwd, watch=watch)
    assert f"{tmp / 'nowhere'}: no such run directory" in line
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(runs["lr-high"] / "config.resolved.toml", bare)
    line = run_cli_error("report", str(bare), cwd=cwd, watch=watch)
    assert f"{bare / 'metrics.jsonl'}: missing file" in line
    line = run_cli_error("report", str(runs["lr-high"]), "--out", str(tmp_path / "no" / "r.html"), cwd=cwd, watch=watch)
    assert "--out" in line and "no such directory" in line
    line = run_cli_error("compare", str(runs["lr-high"]), str(bare), cwd=cwd, watch=watch)
    assert f"{bare / 'metrics.jsonl'}" in line
    line = run_cli_error("runs", "--root", str(root), "--where", "optim.lrr=1", cwd=cwd, watch=watch)
    assert line == "trainbook: error: --where optim.lrr: unknown key 'lrr'; did you mean 'lr'?"
    line = run_cli_error("runs", "--root", str(root), "--where", "optim.lr", cwd=cwd, watch=watch)
    assert line == "trainbook: error: --where: 'optim.lr' is not of the form key.path=value"
    line = run_cli_error("runs", "--root", str(root), "--sort", "speed", cwd=cwd, watch=watch)
    assert line.startswith("trainbook: error: --sort speed: unknown metric 'speed'")
    line = run_cli_error("runs", "--root", str(tmp_path / "none"), cwd=cwd, watch=watch)
    assert f"--root {tmp_path / 'none'}: no such directory" in line


# ---- the pages in a real browser -----------------------------------------------------------------


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on this machine (make .venv/.installed installs Debian's package)")
    pytest.importorskip("playwright.sync_api")
    return path


def render(page_file: Path, screenshot: Path) -> dict:
    """Open `page_file` in headless Chromium: what it requested, what it logged, what it drew."""
    from playwright.sync_api import sync_playwright

    seen = {"requests": [], "console": [], "errors": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("request", lambda r: seen["requests"].append(r.url))
            page.on("console", lambda m: seen["console"].append((m.type, m.text)))
            page.on("pageerror", lambda e: seen["errors"].append(str(e)))
            page.goto(page_file.resolve().as_uri(), wait_until="load")
            page.screenshot(path=str(screenshot), full_page=True)
            seen["charts"] = page.evaluate("""() => [...document.querySelectorAll('svg.chart')].map(svg => {
                const box = svg.getBoundingClientRect();
                return {id: svg.id, declared: Number(svg.dataset.series), width: box.width, height: box.height,
                        cells: Number(svg.dataset.cells || 0),
                        series: [...svg.querySelectorAll('path.series')].map(p => {
                            const b = p.getBBox();
                            return {name: p.dataset.name, points: Number(p.dataset.points),
                                    d: p.getAttribute('d'), width: b.width, height: b.height};
                        }),
                        drawnCells: [...svg.querySelectorAll('rect.cell')].filter(
                            r => r.getBoundingClientRect().width > 0 && r.getBoundingClientRect().height > 0).length};
            })""")
            seen["no_layers_note"] = page.locator("#no-layer-stats").count()
        finally:
            browser.close()
    return seen


def _assert_clean_and_drawn(seen: dict, page_file: Path, screenshot: Path) -> dict[str, dict]:
    assert seen["requests"] == [page_file.resolve().as_uri()]  # the file itself, nothing else
    assert not [m for m in seen["console"] if m[0] == "error"] and not seen["errors"], seen
    assert screenshot.stat().st_size > 10_000
    charts = {c["id"]: c for c in seen["charts"]}
    for c in charts.values():
        assert c["width"] > 0 and c["height"] > 0, c
        if c["cells"]:  # a heatmap: every cell drawn
            assert c["drawnCells"] == c["cells"] > 0, c
            continue
        assert len(c["series"]) == c["declared"], c
        for s in c["series"]:
            assert s["d"] and s["d"].startswith("M") and s["points"] >= 1, s
            assert s["width"] > 0 or s["height"] > 0, s  # not collapsed to nothing
    return charts


def test_report_in_a_browser(archive, tmp_path):
    tmp, _, runs, _ = archive
    done = run_cli("report", str(runs["lr-high"]), cwd=tmp)
    assert done.returncode == 0, done.stderr
    page_file = runs["lr-high"] / "report.html"
    assert done.stdout.strip() == str(page_file)
    seen = render(page_file, tmp_path / "report.png")
    charts = _assert_clean_and_drawn(seen, page_file, tmp_path / "report.png")
    expected = {"chart-loss": 2, "chart-lr": 1, "chart-grad-norm": 1, "chart-throughput": 2, "chart-phases": 7,
                "chart-memory": 1, "chart-events": 3}  # throughput: tokens/s and MFU; events: start,
    # checkpoint (steps 3 and 6), end; phases: all seven, step 6 (logged) saves and evaluates
    assert {k: len(c["series"]) for k, c in charts.items()} == expected
    assert {s["name"] for s in charts["chart-loss"]["series"]} == {"train loss", "val loss"}
    assert charts["chart-loss"]["series"][0]["points"] == STEPS // 2  # log.every_steps = 2
    assert seen["no_layers_note"] == 1  # no layers.jsonl: said so


def test_report_with_layer_statistics_and_a_failed_run(archive, tmp_path):
    """The failed run measured its layers every step (layers.jsonl, written by the run itself)."""
    tmp, _, runs, _ = archive
    run = runs["failed"]
    records = [json.loads(line) for line in (run / "layers.jsonl").read_text().splitlines()]
    blocks = records[0]["blocks"]
    out = tmp_path / "failed.html"
    done = run_cli("report", str(run), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = render(out, tmp_path / "failed.png")
    charts = _assert_clean_and_drawn(seen, out, tmp_path / "failed.png")
    heatmaps = {k: c for k, c in charts.items() if k.startswith("heatmap-")}
    assert set(heatmaps) == {"heatmap-grad-norm", "heatmap-update-ratio", "heatmap-act-std", "heatmap-act-max-abs"}
    assert all(c["cells"] == len(blocks) * len(records) for c in heatmaps.values())
    assert seen["no_layers_note"] == 0
    assert "status-failed" in out.read_text() and "fault injected" in out.read_text()


def test_compare_in_a_browser(archive, tmp_path):
    tmp, _, runs, _ = archive
    out = tmp_path / "compare.html"
    done = run_cli("compare", str(runs["lr-high"]), str(runs["lr-low"]), str(runs["stopped"]), "--out", str(out),
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = render(out, tmp_path / "compare.png")
    charts = _assert_clean_and_drawn(seen, out, tmp_path / "compare.png")
    # One series per run; the stopped run has no evaluations (train.eval_every = 0).
    assert {k: len(c["series"]) for k, c in charts.items()} == {
        "chart-loss": 3, "chart-val-loss": 2, "chart-lr": 3, "chart-grad-norm": 3, "chart-tokens-per-s": 3,
        "chart-memory": 3}
    assert [s["name"] for s in charts["chart-loss"]["series"]] == ["lr-high", "lr-low", "stopped"]
    page = out.read_text()
    assert "<td>optim.lr</td><td>0.004</td><td>0.001</td>" in page
    assert "<td>train.eval_every</td>" in page and "<td>train.max_steps</td><td>6</td><td>6</td><td>100000</td>" in page
