"""One rank of the 2-rank loader test (started by torch.distributed.run, gloo backend).

    loader_ranks_worker.py SHARD_DIR OUT_DIR N_BATCHES MICRO_BATCH SEQ_LEN

Each rank reads N_BATCHES micro-batches of its data-parallel slice and writes, to
OUT_DIR/rank<R>.json, the first input token of every row it was given, batch by batch (the
test finds which global samples those are from the tokens alone), plus every rank's final state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from trainbook.data import TrainLoader
from trainbook.data.shards import TokenStream
from trainbook.parallel.runtime import end_process

WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def main() -> None:
    shard_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    n_batches, micro_batch, seq_len = (int(a) for a in sys.argv[3:6])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    streams = {name: TokenStream(sorted((shard_dir / name).glob("*.bin"))) for name in WEIGHTS}
    loader = TrainLoader(streams, WEIGHTS, seq_len, micro_batch, seed=11, rank=rank,
                         world_size=world_size)
    batches = [next(loader).inputs[:, 0].tolist() for _ in range(n_batches)]
    states = [None] * world_size
    dist.all_gather_object(states, loader.state_dict())  # a real collective across the ranks
    out = {"rank": rank, "world_size": world_size, "first_tokens": batches, "states": states}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    end_process(0)


if __name__ == "__main__":
    main()
