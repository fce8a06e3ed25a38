"""One rank of the resharding test (started by torch.distributed.run, gloo backend).

    reshard_worker.py CKPT_DIR OUT_ROOT

Loads a checkpoint written by one process into a model sharded with FSDP2 over the ranks (its
optimizer state too), checks each rank holds its own shard, then saves it again from all ranks
through the Checkpointer, once synchronously (step 11) and once asynchronously (step 12).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from trainbook.checkpoint import Checkpointer, load_state, tensor_entries
from trainbook.config import CheckpointConfig, ModelConfig
from trainbook.model import build_model, resolve
from trainbook.parallel.runtime import end_process
from trainbook.train.optim import optimizer_state, optimizer_state_like


def main() -> None:
    ckpt, out_root = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(resolve(ModelConfig(name="debug", vocab_size=96)), "cpu", seed=rank + 100)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())

    state = {"model": model.state_dict(), "optim": optimizer_state_like(model, tensor_entries(ckpt)),
             "trainer": {"step": torch.tensor(0)}}
    load_state(ckpt, state)
    wq = state["model"]["layers.0.attention.wq.weight"]
    assert wq.to_local().shape[0] == wq.shape[0] // world_size, (wq.to_local().shape, wq.shape)
    for name, p in model.named_parameters():
        optimizer.state[p] = state["optim"][name]

    for step, mode in ((11, "sync"), (12, "async")):
        saver = Checkpointer(out_root, CheckpointConfig(mode=mode, keep_last=5), rank=rank, world_size=world_size)
        saver.save(step, {"model": model.state_dict(), "optim": optimizer_state(model, optimizer),
                          "trainer": {"step": torch.tensor(step)}})
        saver.close()
    end_process(0)


if __name__ == "__main__":
    main()
