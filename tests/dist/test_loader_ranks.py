"""A real 2-rank run (torch.distributed.run, gloo): data-parallel loader slices are disjoint and complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from trainbook.data import TrainLoader
from trainbook.data.shards import ShardWriter, TokenStream

WORKER = Path(__file__).with_name("loader_ranks_worker.py")
T, B, N_BATCHES = 16, 4, 30  # 2 ranks x 30 x 4 = 240 samples
# Tokens: 130, 80 and 55 samples of T + 1, more than the 240 samples take from each source at
# these weights (120, 72, 48), so no sample is read twice and its tokens name its global index.
SIZES = {"web": 2081, "code": 1281, "books": 881}
WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def write_sources(root: Path) -> dict[str, TokenStream]:
    """Token at position p of source k is k * 10**6 + p; several shards per source."""
    streams = {}
    for k, (name, n) in enumerate(SIZES.items()):
        (root / name).mkdir(parents=True)
        writer = ShardWriter(root / name, "train", np.dtype(np.uint32), 512)
        writer.add(k * 10**6 + np.arange(n))
        streams[name] = TokenStream([root / name / f for f in writer.close()])
    return streams


def test_two_ranks_read_disjoint_and_complete_slices(tmp_path):
    streams = write_sources(tmp_path / "shards")
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(WORKER), str(tmp_path / "shards"), str(out), str(N_BATCHES), str(B), str(T)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert proc.returncode == 0, log[-3000:]

    # The global index of every row a rank was given, found from its tokens: (source, sample)
    # from the first token, then that sample's place in the single-process order (world size 1).
    n = 2 * N_BATCHES * B
    source, sample = TrainLoader(streams, WEIGHTS, T, B, seed=11).order.sample_ids(np.arange(n))
    index = {(int(s), int(i)): g for g, (s, i) in enumerate(zip(source, sample))}
    assert len(index) == n  # premise: no sample is read twice, so tokens identify the index

    def global_ids(first_tokens: list[int]) -> list[int]:
        tokens = np.array(first_tokens)
        assert (tokens % 10**6 % T == 0).all()  # every row starts on a sample boundary
        return [index[(int(s), int(i))] for s, i in zip(tokens // 10**6, tokens % 10**6 // T)]

    ids = [[global_ids(batch) for batch in r["first_tokens"]] for r in ranks]
    read = [{g for batch in rank_ids for g in batch} for rank_ids in ids]
    assert sum(len(batch) for rank_ids in ids for batch in rank_ids) == n
    assert not read[0] & read[1]  # disjoint
    assert read[0] | read[1] == set(range(n))  # complete: none skipped
    # Micro-batch k of rank r holds global samples [(k * world_size + r) * B, + B), in order.
    for r, rank_ids in enumerate(ids):
        assert rank_ids == [list(range((k * 2 + r) * B, (k * 2 + r + 1) * B)) for k in range(N_BATCHES)]
    assert all(r["states"] == [{"consumed": n}] * 2 for r in ranks)
