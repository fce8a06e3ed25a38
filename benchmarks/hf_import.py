"""Hugging Face Llama import: wall time and peak RSS for a >= 1 GB safetensors directory.

A random Llama-shaped directory (config.json + safetensors, sharded with an index when
`--shard-gb` is below the total, one `model.safetensors` otherwise, as transformers 5 writes any
model under 50 GB) is written straight with `safetensors.torch.save_file`, no transformers model
needed. Each measurement then runs in a fresh subprocess, so its peak RSS is the import's alone
plus the interpreter with torch and trainbook imported (reported apart as "baseline"). Peak RSS
is the child's VmHWM: `ru_maxrss` would report this script's own peak (Linux carries a parent's
high-water mark through fork and exec). Before each measurement the files' pages are dropped
from the page cache (posix_fadvise), so the read comes from disk, not from what the writer left.

Paths measured (all end with the same fp32 model in memory):
- `trainer`: `model_config_from_hf` + `build_model` (random init on every page) + `load_hf_weights`;
  the path `trainbook run` takes;
- `no-init`: the model built on the meta device, `to_empty`, `load_hf_weights`, RoPE tables:
  what skipping the throw-away init would save;
- `load_file` (reference, not trainbook's): every file read whole with `safetensors.torch.load_file`,
  then `load_state_dict`: the second full copy the loader avoids.

The model must live in memory (1x its fp32 size); goal: peak RSS <= 1.5x the bytes on disk. For a
bf16 directory (`--dtype bf16`) the fp32 model alone is 2x the bytes on disk, so compare against
the model's size there. Times on a shared 2-core VM vary by 2x from run to run; RSS does not.

    .venv/bin/python benchmarks/hf_import.py [--gb 1.2] [--dtype fp32|bf16] [--shard-gb 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainbook.config import ModelConfig
from trainbook.model import build_model, num_params
from trainbook.model.hf import hf_config, to_hf_state_dict

GB = 1e9
# Llama-shaped (head_dim 128, GQA 4:1, a 32K vocabulary, untied head: two 262 MB fp32 matrices,
# the largest tensors); the number of blocks (~180 MB fp32 each) sets the size.
SHAPE = dict(dim=2048, n_heads=16, n_kv_heads=4, ffn_dim=5632, vocab_size=32000, norm_eps=1e-5,
             rope_theta=500000.0, max_seq_len=4096, tie_embeddings=False, init_std=0.02)  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
from safetensors.torch import load_file
from trainbook.model import build_model
from trainbook.model.hf import from_hf_name
from trainbook.model.hf_import import load_hf_weights, model_config_from_hf
from trainbook.model.llama import Llama, rope_tables

def rss_mb():
    # Peak RSS of this process's memory since exec (VmHWM, KiB). Not ru_maxrss: Linux carries
    # the forking parent's high-water mark through fork and exec into it.
    status = Path("/proc/self/status").read_text()
    return int(next(l for l in status.splitlines() if l.startswith("VmHWM:")).split()[1]) / 1024

path, mode = Path(sys.argv[1]), sys.argv[2]
baseline = rss_mb()
t0 = time.perf_counter()
cfg = model_config_from_hf(path)
if mode == "no-init":
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
else:
    model = build_model(cfg, "cpu", seed=0)
t1 = time.perf_counter()
if mode == "load_file":
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update({from_hf_name(k): v for k, v in load_file(f).items()})
    model.load_state_dict(state, strict=False)
else:
    load_hf_weights(model, path)
if mode == "no-init":
    with torch.no_grad():
        cos, sin = rope_tables(cfg)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
t2 = time.perf_counter()
print(json.dumps({"build_s": t1 - t0, "load_s": t2 - t1, "peak_mb": rss_mb(), "baseline_mb": baseline}))
"""


def write_hf_dir(out: Path, gb: float, dtype: torch.dtype, shard_gb: float) -> tuple[int, int]:
    """A random Llama of about `gb` GB in `dtype`, as save_pretrained lays it out; returns (bytes
    on disk of the weights, bytes of the fp32 model)."""
    size = dtype.itemsize

    def params(n_layers: int) -> int:
        cfg = ModelConfig(name="from_hf", n_layers=n_layers, **SHAPE)
        return num_params(build_model(cfg, "meta", seed=0))

    per_layer = params(2) - params(1)
    n_layers = max(1, round((gb * GB / size - (params(1) - per_layer)) / per_layer))
    cfg = ModelConfig(name="from_hf", n_layers=n_layers, **SHAPE)
    meta = build_model(cfg, "meta", seed=0)
    shapes = {k: tuple(v.shape) for k, v in to_hf_state_dict(meta.state_dict(), tied=False).items()}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2))

    # Shards filled in state-dict order, each at most shard_gb (a bigger tensor gets one alone).
    gen = torch.Generator().manual_seed(0)
    shards, current, current_bytes = [], [], 0
    for name, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * size
        if current and current_bytes + nbytes > shard_gb * GB:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    shards.append(current)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(dtype) for n in names}
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    if len(shards) > 1:
        total = sum(torch.Size(s).numel() * size for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return disk, num_params(meta) * 4


def drop_page_cache(directory: Path) -> None:
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(directory: Path, mode: str) -> dict:
    drop_page_cache(directory)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(directory), mode],
                          capture_output=True, text=True, check=True)  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.2, help="weights on disk, about")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="max shard size (HF's 4.x default: 5)")
    parser.add_argument("--modes", default="trainer,no-init,load_file")
    parser.add_argument("--dir", default=None, help="where to write the directory (default: a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp) / "hf"
        t0 = time.perf_counter()
        disk, model_bytes = write_hf_dir(directory, args.gb, DTYPES[args.dtype], args.shard_gb)
        files = len(list(directory.glob("*.safetensors")))
        print(f"wrote {disk / GB:.2f} GB of {args.dtype} weights in {files} file(s) "
              f"({time.perf_counter() - t0:.1f} s); the fp32 model is {model_bytes / GB:.2f} GB")  # fmt: skip
        print(f"{'path':<10} {'wall s':>7} {'build s':>8} {'load s':>7} {'peak RSS':>9} {'baseline':>9} "
              f"{'peak/disk':>10} {'(peak-base)/disk':>17}")  # fmt: skip
        for mode in args.modes.split(","):
            r = measure(directory, mode)
            peak, base = r["peak_mb"] * 2**20, r["baseline_mb"] * 2**20
            print(f"{mode:<10} {r['wall_s']:7.2f} {r['build_s']:8.2f} {r['load_s']:7.2f} {peak / GB:7.2f}GB "
                  f"{base / GB:7.2f}GB {peak / disk:10.2f} {(peak - base) / disk:17.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
