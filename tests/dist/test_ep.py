"""Expert parallelism computes what one process computes: 2 real gloo ranks at parallel.ep = 2
(tests/dist/ep_worker.py, one launch) against the whole model on the whole batch, 3 AdamW steps.

In fp64 (the routers and the combine in fp32, as always), so the only differences left are the
order of sums (a rank's experts add their rows from both ranks in one matmul; FSDP averages the
rest), the fp32 combine rounding fp64 outputs that differ in their last bits to different fp32
ones now and then, and AdamW's 1 / sqrt(v), which magnifies all of it in near-zero gradients:
measured here, loss 2.2e-10, gradient norm 1.1e-8, parameters 8.2e-8 (the worst tensor's
|a - b| / |b|, a router gate) and 8.2e-7 element-wise (max |a - b| / max |b|, an expert's w2)
after step 3, with clipping to 1.0 active in every step (the norms are ~5).
In fp32 the same comparison leaves the parameters ~4e-4 apart after 3 steps at lr 1e-3 in this
tiny batch, through AdamW alone (plain FSDP over 2 ranks does the same); the CLI test in
tests/e2e/test_moe.py holds the fp32 recipe to the layouts' bounds.

A wrong expert-gradient scale (FSDP's mean over the ranks holding an expert, without the 1 / ep of
parallel/ep.py) leaves losses and routing as they are in step 1 and doubles the experts' gradient:
`experts_grad_norm` is compared as a ratio, before clipping.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainbook.checkpoint import load_state, tensor_entries

ROOT = Path(__file__).resolve().parents[2]
REL = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("ep")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.dist.ep_worker", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    files = [out / f"rank{r}.pt" for r in range(2)]
    assert proc.returncode == 0 and all(f.exists() for f in files), (proc.stdout + proc.stderr)[-3000:]
    return out, [torch.load(f, weights_only=True) for f in files]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_two_expert_parallel_ranks_train_as_one_process(ranks):
    _, (first, second) = ranks
    for step, (ref, ep) in enumerate(zip(first["ref"]["steps"], first["ep"]["steps"]), 1):
        assert ep["loss"] == pytest.approx(ref["loss"], rel=REL), step
        assert ep["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL), step
        # The experts' gradient as one process's, not ep times it.
        assert ep["experts_grad_norm"] / ref["experts_grad_norm"] == pytest.approx(1.0, abs=REL), step
        assert torch.equal(ep["counts"], ref["counts"]), step  # every router, every expert: the same tokens
    ref, ep = first["ref"]["state"], first["ep"]["state"]
    assert ref.keys() == ep.keys()
    worst = max((((ep[k] - ref[k]).norm() / ref[k].norm()).item(), k) for k in ref if "expert_bias" not in k)
    assert worst[0] <= REL, worst
    worst = max((_relative(ep[k], ref[k]), k) for k in ref if "expert_bias" not in k)
    assert worst[0] <= 2 * REL, worst
    biases = [k for k in ref if k.endswith("expert_bias")]
    assert len(biases) == 3 and all(torch.equal(ep[k], ref[k]) for k in biases)
    assert any(ref[k].abs().sum() > 0 for k in biases)  # the bias rule moved them
    # Both ranks hold the same whole model at the end.
    assert all(torch.equal(second["ep"]["state"][k], ep[k]) for k in ep)


def test_a_step_where_one_ranks_experts_get_no_token(ranks):
    """Step 2 sends every token to experts 0 and 1 (rank 0's): rank 1's experts receive no row
    from any rank, in every MoE layer, forward and recompute, and still train as one process's."""
    _, (first, second) = ranks
    idle = second["ep"]["steps"][1]
    assert idle["received"] == [0] * 6  # 3 MoE layers, forward and checkpointed recompute
    assert all(n > 0 for n in first["ep"]["steps"][1]["received"])
    assert all(n > 0 for r in (first, second) for s in (0, 2) for n in r["ep"]["steps"][s]["received"])
    counts = first["ref"]["steps"][1]["counts"]
    assert (counts[:, 2:] == 0).all() and (counts[:, :2] > 0).all()


def test_a_checkpoint_reshards_between_ep_2_and_ep_1_bit_for_bit(ranks):
    """Saved at ep = 2, loaded under plain FSDP (ep = 1) and saved, loaded at ep = 2 again, and
    both checkpoints read whole in this process: model and AdamW moments equal the trained state
    bit for bit at every hop."""
    out, _ = ranks
    saved = torch.load(out / "saved-rank0.pt", weights_only=True)
    hops = [torch.load(out / f"loaded{step}-rank{rank}.pt", weights_only=True) for step in (3, 4) for rank in (0, 1)]
    for loaded in hops:
        for part in ("model", "optim"):
            assert loaded[part].keys() == saved[part].keys()
        assert all(torch.equal(loaded["model"][k], v) for k, v in saved["model"].items())
        assert all(torch.equal(loaded["optim"][k][s], t) for k, v in saved["optim"].items() for s, t in v.items())
    experts = [k for k in saved["optim"] if k.endswith("experts.w1")]
    assert len(experts) == 3 and saved["optim"][experts[0]]["exp_avg"].shape[0] == 8
    for step in (3, 4):  # one process reads each
        ckpt = out / "ckpt" / f"step-{step}"
        shapes = {k.removeprefix("model."): tuple(v.size) for k, v in tensor_entries(ckpt).items()
                  if k.startswith("model.")}
        model = {name: torch.empty(shape, dtype=torch.float64) for name, shape in shapes.items()}
        load_state(ckpt, {"model": model})
        assert all(torch.equal(model[k], v) for k, v in saved["model"].items()), step
