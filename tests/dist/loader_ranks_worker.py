"""One rank of the 2-rank loader test (started by torch.distributed.run, gloo backend).

    loader_ranks_worker.py SHARD_DIR OUT_DIR N_BATCHES MICRO_BATCH SEQ_LEN

Each rank reads N_BATCHES micro-batches of its data-parallel slice and writes, to
OUT_DIR/rank<R>.json, the global sample ids the loader says it read (from its position) and the
first input token of each row (what it actually read), plus every rank's final state.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from trainbook.data import TrainLoader
from trainbook.data.shards import TokenStream

WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def main() -> None:
    shard_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    n_batches, micro_batch, seq_len = (int(a) for a in sys.argv[3:6])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    streams = {name: TokenStream(sorted((shard_dir / name).glob("*.bin"))) for name in WEIGHTS}
    loader = TrainLoader(streams, WEIGHTS, seq_len, micro_batch, seed=11, rank=rank,
                         world_size=world_size)
    global_ids, first_tokens = [], []
    for _ in range(n_batches):
        # Micro-batch k of rank r: global samples [consumed + r * B, + B), consumed = k * W * B.
        lo = loader.state_dict()["consumed"] + rank * micro_batch
        global_ids += range(lo, lo + micro_batch)
        first_tokens += next(loader).inputs[:, 0].tolist()
    states = [None] * world_size
    dist.all_gather_object(states, loader.state_dict())  # a real collective across the ranks
    out = {"rank": rank, "world_size": world_size, "global_ids": global_ids,
           "first_tokens": first_tokens, "states": states}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    # gloo can abort at interpreter exit after all work is done (DESIGN.md): skip the teardown.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
