"""A checkpoint someone sent you cannot run code: every command that opens one refuses a `.metadata`
pickle that would, before it runs, even when the manifest's checksums have been updated to match."""

import json
import pickle
import shutil
import zlib
from pathlib import Path

import pytest

from tests.conftest import prepared_recipe, run_cli

pytestmark = pytest.mark.slow


class _Touch:
    """Unpickling this creates `marker` (what an attacker's `.metadata` would do instead)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, debug_data) -> tuple[Path, Path]:
    """(recipe, run directory) of one short run with a committed checkpoint."""
    tmp = tmp_path_factory.mktemp("safety")
    recipe = prepared_recipe(tmp, debug_data)
    run_dir = tmp / "run"
    done = run_cli("run", str(recipe), "--run-dir", str(run_dir), "train.max_steps=2", "train.eval_every=0")
    assert done.returncode == 0, done.stderr
    return recipe, run_dir


def _tamper(run_dir: Path, into: Path) -> tuple[Path, Path]:
    """A copy of the run whose checkpoint's `.metadata` would create a file when unpickled, its
    manifest's size and CRC-32 updated as an attacker would. Returns (checkpoint, marker)."""
    shutil.copytree(run_dir, into)
    ckpt = into / "checkpoints" / "step-2"
    marker = into.parent / f"{into.name}-pwned"
    payload = pickle.dumps(_Touch(marker))
    (ckpt / ".metadata").write_bytes(payload)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": len(payload), "crc32": f"{zlib.crc32(payload):08x}"}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt, marker


@pytest.mark.parametrize("command", ["sample-run", "sample-checkpoint", "export", "resume"])
def test_every_command_that_opens_a_checkpoint_refuses_a_metadata_that_would_run_code(trained, tmp_path, command):
    recipe, run_dir = trained
    ckpt, marker = _tamper(run_dir, tmp_path / "sent")
    args = {
        "sample-run": ["sample", str(ckpt.parent.parent), "--max-new-tokens", "2"],
        "sample-checkpoint": ["sample", str(ckpt), "--max-new-tokens", "2"],
        "export": ["export", str(ckpt), "--format", "safetensors", "--out", str(tmp_path / "out")],
        "resume": ["run", str(recipe), "--run-dir", str(tmp_path / "again"), "--resume", str(ckpt),
                   "train.max_steps=4", "train.eval_every=0"],
    }[command]
    done = run_cli(*args)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainbook: error: ")]
    assert len(errors) == 1 and f"{ckpt / '.metadata'}: " in errors[0] and "io.open" in errors[0], done.stderr
    assert not marker.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
