"""Pipeline parallel (torch.distributed.run, gloo, real processes) against one process.

Every layout trains the debug model (fp32) from the same init on the same batches, 3 AdamW steps
of 2 accumulated passes with gradient clipping and an eval after each step; every step's loss,
gradient norm and eval loss must match the single-process run (lm_loss on each whole batch)
within 1e-5 relative.

Final parameters are compared within 3e-5 relative (per tensor, in norm) to a single-process run
that cuts each batch into the same rows per chunk as the pipeline does. Not to the whole-batch
run: AdamW divides each element's gradient by its own magnitude, so elements whose gradient is
near zero turn a summation-order rounding difference into a visible update difference. Measured
here, one process, whole batches vs 2 chunks (mathematically the same gradient): 3.4e-5 relative
after 3 steps at lr 1e-2, 8e-6 at lr 1e-3; the pipeline vs the chunked run: 1.3e-6, but up to
1.1e-5 with FSDP over 2 data-parallel ranks on some CPUs (each rank accumulates its own chunks,
then the reduce-scatter averages them: a third summation order). A wrong gradient (a missing or
doubled chunk, an unsummed tied copy) moves weights by 1e-2 relative and more.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.dist.pipeline_worker import ACCUM, CLIP, LR, STEPS, batches, model_config

from trainbook.errors import TrainbookError
from trainbook.model import build_model

from trainbook.parallel.pipeline import cut_stage, model_stage_layers, stage_layers
from trainbook.train.engine import lm_loss

WORKER = Path(__file__).with_name("pipeline_worker.py")
# SCHEDULE:STAGES_PER_RANK:TIED[:DP_SHARD]; all 2-rank cases share one launch (one torch import).
TWO_RANKS = ["gpipe:1:untied", "1f1b:1:untied", "interleaved1f1b:2:untied", "1f1b:1:tied",
             "interleaved1f1b:2:tied"]
FOUR_RANKS = ["1f1b:1:untied:2", "gpipe:1:tied:2"]  # FSDP2 x PP


def launch(out: Path, nproc: int, cases: list[str]) -> dict[str, list[dict]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), str(out), *cases]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    log = proc.stdout + proc.stderr
    files = {c: [out / f"{c.replace(':', '-')}-rank{r}.pt" for r in range(nproc)] for c in cases}
    assert all(f.exists() for fs in files.values() for f in fs), log[-3000:]
    assert proc.returncode == 0, log[-3000:]
    return {c: [torch.load(f, weights_only=True) for f in fs] for c, fs in files.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("pipeline")
    return launch(out, 2, TWO_RANKS) | launch(out, 4, FOUR_RANKS)


def reference(tied: bool, chunks: int = 1) -> dict:
    """The same training on one process: lm_loss / accum per pass (each pass cut into `chunks`
    equal pieces, each back-propagating its share), clip, AdamW."""
    model = build_model(model_config(tied), "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = batches()
    losses, norms, evals = [], [], []
    for step in range(STEPS):
        total = 0.0
        for k in range(ACCUM):
            inputs, targets = data[step * ACCUM + k]
            for x, y in zip(inputs.chunk(chunks), targets.chunk(chunks)):
                loss = lm_loss(model(x), y)
                (loss / (ACCUM * chunks)).backward()
                total += loss.item() / chunks
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / ACCUM)
        with torch.no_grad():
            evals.append(lm_loss(model(data[-1][0]), data[-1][1]).item())
    # named_parameters drops the tied head (same tensor): name it too, for the last stage's copy.
    params = dict(model.named_parameters()) | {"output.weight": model.output.weight}
    return {"losses": losses, "norms": norms, "evals": evals, "params": params}


def close(a, b) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return torch.allclose(a, b, rtol=1e-5, atol=0.0)


def close_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() <= 3e-5 * b.norm()).item()


@pytest.mark.parametrize("case", TWO_RANKS + FOUR_RANKS)
def test_pipeline_matches_one_process(results, case):
    schedule, per_rank, tied, *rest = case.split(":")
    ranks, ref = results[case], reference(tied == "tied")
    # Rows per pipeline chunk: B / (data-parallel ranks x micro-batches); here B / chunks.
    n_stages = 2 * int(per_rank)
    chunked = reference(tied == "tied", chunks=n_stages * (int(rest[0]) if rest else 1))
    last = [r for r in ranks if r["losses"]]
    assert last, "no rank reported losses"
    # Each data-parallel rank reports the losses of its own rows: their mean is the whole batch's.
    for key in ("losses", "evals"):
        mean = [sum(r[key][i] for r in last) / len(last) for i in range(STEPS)]
        assert close(mean, ref[key]), (key, mean, ref[key])
    for r in ranks:
        assert close(r["norms"], ref["norms"]), (r["norms"], ref["norms"])
        # `share` hands every pipeline rank the last stage's eval loss (of its own data rows).
        own = next(x for x in last if x["coord"]["dp_shard"] == r["coord"]["dp_shard"])
        assert r["shared_evals"] == own["evals"]

    held = {}
    for r in ranks:
        for name, value in r["params"].items():
            assert close_tensor(value, chunked["params"][name]), name
            held.setdefault(name, set()).add(r["coord"]["pp"])
    assert set(held) == set(ref["params"])  # every parameter lives on some stage
    assert all(len(on) == 1 for on in held.values())  # ... on exactly one pipeline rank


def test_tied_copies_stay_bitwise_equal(results):
    ranks = results["1f1b:1:tied"]
    emb = next(r["params"]["tok_embeddings.weight"] for r in ranks if "tok_embeddings.weight" in r["params"])
    head = next(r["params"]["output.weight"] for r in ranks if "output.weight" in r["params"])
    assert torch.equal(emb, head)


def test_interleaved_stage_placement(results):
    # 4 layers, 4 stages, 2 per rank: rank r holds stages r and r + 2 (loop-style).
    by_rank = {r["rank"]: r["layers"] for r in results["interleaved1f1b:2:untied"]}
    assert by_rank == {0: [[0], [2]], 1: [[1], [3]]}


def test_stage_layers_manual_split():
    assert stage_layers(6, 3, [1, 3, 2], [10] * 6) == [range(0, 1), range(1, 4), range(4, 6)]
    with pytest.raises(TrainbookError, match="pp_split"):
        stage_layers(6, 3, [3, 3], [10] * 6)
    with pytest.raises(TrainbookError, match="pp_split"):
        stage_layers(6, 2, [6, 0], [10] * 6)


def test_stage_layers_balanced():
    # Equal layers, nothing extra: an even split; a remainder goes to the later stages.
    assert stage_layers(8, 4, None, [10] * 8) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(5, 2, None, [10] * 5) == [range(0, 2), range(2, 5)]
    # A 20-parameter embedding weighs as much as two layers: stage 0 takes two fewer.
    assert stage_layers(6, 2, None, [10] * 6, first_params=20) == [range(0, 2), range(2, 6)]
    # ... and a head on the last stage pulls layers the other way.
    assert stage_layers(6, 2, None, [10] * 6, first_params=20, last_params=20) == [range(0, 3), range(3, 6)]
    # Uneven layers: the heaviest stage is as light as it can be.
    assert stage_layers(4, 2, None, [30, 10, 10, 10]) == [range(0, 1), range(1, 4)]
    # One layer per stage when there are as many stages as layers.
    assert stage_layers(3, 3, None, [1, 100, 1]) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(TrainbookError, match="at least 4 layers"):
        stage_layers(3, 4, None, [1, 1, 1])


def test_model_stage_layers_and_cut_stage():
    model = build_model(model_config(tied=False), "meta", seed=0)
    layers = model_stage_layers(model, 2, None)
    assert layers == [range(0, 2), range(2, 4)]  # embedding and head weigh the same here
    first = cut_stage(model, layers[0], is_first=True, is_last=False)
    last = cut_stage(model, layers[1], is_first=False, is_last=True)
    assert list(first.layers) == ["0", "1"] and first.norm is None and first.output is None
    assert list(last.layers) == ["2", "3"] and last.tok_embeddings is None
    assert len(model.layers) == 4 and model.output is not None  # the whole model is untouched
    names = {n for m in (first, last) for n, _ in m.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
