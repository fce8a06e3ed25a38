"""An NCCL process group of one rank on this GPU with trainbook's flight-recorder settings
(parallel/flight.py), three all-reduces, and the recorder's dump as the hang watchdog writes it
(benchmarks/accelerator.sh calls it). usage: accelerator_nccl.py OUT_FOLDER"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainbook.parallel import flight


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29517")})
    flight.enable("nccl")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    backend = dist.get_backend()
    dumped = flight.dump(out / "rank0")
    print(f"nccl process group: ok (backend {backend}, all_reduce sum {x[0].item():.0f})")
    print(f"flight recorder dump: {'ok' if dumped else 'FAILED'} ({out / 'rank0'}; status {flight.status()})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
