"""What the side-by-side comparisons with TRL share (benchmarks/sft_vs_trl.py, dpo_vs_trl.py,
grpo_vs_trl.py): the TRL venv's python (benchmarks/sft_vs_trl_venv.sh makes it) and how its side
is run, the tables of a one-process CPU recipe on the work folder's Hugging Face model, a
trainbook Trainer of such a recipe, and the largest parameter difference."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import torch

from trainbook.commands.preflight import prepare_data
from trainbook.commands.resolve import resolve
from trainbook.runs import create_run_dir
from trainbook.train.build import one_process

HERE = Path(__file__).resolve().parent
TRL_PYTHON = HERE / ".venv-trl" / "bin" / "python"


def need_trl_venv() -> None:
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `bash benchmarks/sft_vs_trl_venv.sh` first")


def run_trl(script: str, spec: Path, out: Path) -> None:
    """benchmarks/SCRIPT in the TRL venv on `spec`, writing into `out`; its stderr on failure."""
    done = subprocess.run([str(TRL_PYTHON), str(HERE / script), str(spec), str(out)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the TRL side ({script}) failed:\n{done.stderr[-4000:]}")


def recipe_head(work: Path, name: str, args) -> str:
    """The [run] and [model] tables of a benchmark's recipe: one CPU process on the work folder's
    Hugging Face model (benchmarks/dpo_vs_trl.py and grpo_vs_trl.py share them)."""
    return f"""[run]
name = "{name}"
seed = 0
device = "cpu"
threads = {args.threads}
runs_root = "{work / 'runs'}"

[model]
name = "from_hf"
init_from = "hf:{work / 'model'}"
"""


def adamw_tail(lr: float, grad_clip: float) -> str:
    """The optimizer, schedule, monitor and env tables the TRL comparisons share: fp32 AdamW as
    TRL's `adamw_torch` (no weight decay, betas 0.9/0.999, eps 1e-8), a constant LR, no warmup."""
    return f"""[optim]
lr = {lr}
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.999
eps = 1e-8
grad_clip = {grad_clip}

[schedule]
kind = "constant"
warmup_steps = 0

[monitor]
tensorboard = false

[env]
enforce = false
"""


@contextlib.contextmanager
def trainer_of(recipe: Path, work: Path, tag: str):
    """A one-process trainbook Trainer of `recipe` (its console output kept in a file)."""
    res = resolve(recipe, [], world_size=1)
    with open(work / f"{tag}.console", "w") as console, contextlib.redirect_stdout(console):
        data = prepare_data(res, log=print)
        run_dir = create_run_dir(work / "runs", tag, work / "runs" / f"{tag}-{time.time_ns()}")
        trainer = one_process(res.cfg, run_dir, data, torch.device("cpu"))
        try:
            yield trainer, data, res.cfg
        finally:
            trainer.close()



def max_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> tuple[float, str, int]:
    """(largest |difference|, where, tensors compared) over the names both hold; every name of
    `ours` must be in `theirs`."""
    missing = sorted(set(ours) - set(theirs))
    assert not missing, f"not on the TRL side: {missing[:5]}"
    worst, where = 0.0, ""
    for k, v in ours.items():
        d = (v.float() - theirs[k].float()).abs().max().item()
        if d > worst:
            worst, where = d, k
    return worst, where, len(ours)
