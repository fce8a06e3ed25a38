#!/usr/bin/env bash
# The accelerator suite: everything trainbook should measure on a GPU, in one call.
#
#   benchmarks/accelerator.sh [--dry-run] [--wheels DIR] [--steps N] [--legs bench,peer,cuda]
#
# 1. Sets the project up: with --dry-run as `make` does (.venv, pinned CPU torch); on a GPU
#    machine on the python3 that holds its CUDA torch (a venv with its site packages), adding
#    trainbook's own dependencies from --wheels DIR when they are missing (no network there).
# 2. `trainbook bench model` on three shapes, bf16, one GPU, compile off and on: the tiny recipe,
#    llama3.2-1b, and llama3-8b cut to 4 layers. Each records tokens/s, MFU, the phase split, and
#    peak memory against `trainbook plan`'s estimate (bench-<shape>-<compile>.json).
# 3. torchtitan 0.3.0 (its PyPI package, from --wheels DIR, in a venv of its own under a temporary
#    folder) on the same shapes, eager and compiled, when it can be installed: the ratio table
#    (table.txt) holds trainbook/torchtitan tokens/s per shape; without it, trainbook's figures.
# 4. The CUDA-only paths, each a real run: the pinned-memory loader (data.pin_memory), an NCCL
#    process group and its flight-recorder dump, the allocator's memory snapshot on a provoked OOM
#    (the `model.block_oom` fault with diagnose.memory_history).
#
# --legs picks some of 2-4 (all by default), to re-run one leg inside a short lease. The GPU image's
# torch need not be the version the recipes lock (`[env]`): its runs pass --no-check, and the table
# names the torch that ran.
#
# Everything goes under $OUT (a new temporary folder when unset); nothing else is written but the
# set-up. --dry-run runs on a CPU in seconds: tiny shapes, fp32, compile off, one step, the CUDA
# paths and the peer reported as skipped. tests/e2e/test_accelerator_suite.py runs it that way.
set -euo pipefail

dry=0 wheels="" steps=5 legs="bench,peer,cuda"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --wheels) wheels=${2:?--wheels needs a folder}; shift ;;
    --steps) steps=${2:?--steps needs a number}; shift ;;
    --legs) legs=${2:?--legs needs a list (bench,peer,cuda)}; shift ;;
    *) echo "accelerator.sh: unknown argument $1 (--dry-run, --wheels DIR, --steps N, --legs LIST)" >&2; exit 2 ;;
  esac
  shift
done
for leg in ${legs//,/ }; do
  [[ $leg == bench || $leg == peer || $leg == cuda ]] \
    || { echo "accelerator.sh: unknown leg $leg in --legs (bench, peer, cuda)" >&2; exit 2; }
done
leg() { [[ ",$legs," == *",$1,"* ]]; }
repo=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d -t trainbook-accel-XXXXXX)}
mkdir -p "$OUT"
work=$(mktemp -d -t trainbook-accel-work-XXXXXX)
trap 'rm -rf "$work"' EXIT
log() { echo "[accelerator] $*" | tee -a "$OUT/suite.log"; }

# ---- 1. set-up -------------------------------------------------------------------------------
if [[ $dry == 1 ]]; then
  make -C "$repo" .venv/.installed >/dev/null
  py="$repo/.venv/bin/python"
else
  # A venv that sees python3's packages. python3 may itself be a venv's (the GPU image's is), whose
  # packages --system-site-packages does not reach: a .pth names its site folders.
  gpu_venv() {
    python3 -m venv --system-site-packages "$1"
    python3 -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' \
      > "$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_outer.pth"
  }
  gpu_venv "$work/venv"
  py="$work/venv/bin/python"
  if [[ -n $wheels ]]; then
    "$py" -m pip install -q --no-index --find-links "$wheels" --no-deps --no-compile "$wheels"/*.whl 2>>"$OUT/suite.log" || true
  fi
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e "$repo" >>"$OUT/suite.log" 2>&1 \
    || export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
fi
tb() { (cd "$work" && "$py" -m trainbook "$@"); }
"$py" -c "import torch, trainbook; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/suite.log"
cuda=$("$py" -c "import torch; print(int(torch.cuda.is_available()))")
if [[ $dry == 0 && $cuda == 0 ]]; then
  log "no CUDA device: run with --dry-run on a CPU"; exit 2
fi

# ---- 2. trainbook on three shapes ----------------------------------------------------------------
declare -A shape_recipe shape_over
if [[ $dry == 1 ]]; then
  tiny="model.dim=64 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.vocab_size=512 train.seq_len=64 train.micro_batch_size=2 train.global_batch_tokens=128"
  shape_recipe=([tiny]=tiny-shakespeare [1b]=llama3.2-1b [8b-4l]=llama3-8b)
  shape_over=([tiny]="$tiny" [1b]="$tiny" [8b-4l]="$tiny model.n_layers=1")
  common="precision.dtype=fp32 run.device=cpu"
  compiles="false"
  steps=1
else
  shape_recipe=([tiny]=tiny-shakespeare [1b]=llama3.2-1b [8b-4l]=llama3-8b)
  shape_over=([tiny]="" [1b]="train.micro_batch_size=auto" [8b-4l]="model.n_layers=4 train.micro_batch_size=auto")
  common="precision.dtype=bf16 run.device=cuda train.max_steps=1000"
  compiles="false true"
fi
leg bench && for shape in tiny 1b 8b-4l; do
  for c in $compiles; do
    log "bench model $shape compile=$c"
    # shellcheck disable=SC2086
    tb bench model "$repo/recipes/${shape_recipe[$shape]}.toml" ${shape_over[$shape]} $common \
      "train.compile=$c" --steps "$steps" --json "$OUT/bench-$shape-$c.json" | tee -a "$OUT/suite.log"
  done
done

# ---- 3. torchtitan 0.3.0 on the same shapes -----------------------------------------------------
peer="skipped"
if ! leg peer; then
  peer="skipped (--legs)"
elif [[ $dry == 1 ]]; then
  peer="skipped (--dry-run)"
elif [[ -n $wheels ]] && ls "$wheels"/torchtitan-0.3.0-*.whl >/dev/null 2>&1; then
  gpu_venv "$work/tt"
  if "$work/tt/bin/python" -m pip install -q --no-index --find-links "$wheels" torchtitan==0.3.0 >>"$OUT/suite.log" 2>&1; then
    peer="torchtitan 0.3.0"
    # It needs the torch it was released against (torch.distributed.fsdp.DataParallelMeshDims, not
    # in 2.11): say so once rather than fail six runs.
    if ! why=$("$work/tt/bin/python" -c "import torchtitan.train" 2>&1); then
      peer="skipped (torchtitan 0.3.0 does not import on torch $("$py" -c 'import torch; print(torch.__version__)'): $(tail -1 <<<"$why"))"
    fi
    [[ $peer == "torchtitan 0.3.0" ]] && for shape in tiny 1b 8b-4l; do
      for c in $compiles; do
        log "torchtitan $shape compile=$c"
        "$py" "$repo/benchmarks/accelerator_peer.py" --python "$work/tt/bin/python" --shape "$shape" \
          --compile "$c" --steps $((steps + 5)) --work "$work/tt-$shape-$c" \
          --out "$OUT/peer-$shape-$c.json" >>"$OUT/suite.log" 2>&1 || log "torchtitan $shape compile=$c failed (suite.log)"
      done
    done
  else
    peer="skipped (torchtitan 0.3.0 did not install from $wheels; suite.log)"
  fi
else
  peer="skipped (no torchtitan-0.3.0 wheel in --wheels)"
fi
log "peer: $peer"

# ---- 4. CUDA-only paths -----------------------------------------------------------------------------
if ! leg cuda; then
  log "cuda paths: skipped (--legs)"
elif [[ $dry == 1 ]]; then
  log "cuda paths: skipped (--dry-run: pinned-memory loader, NCCL + flight recorder, OOM memory snapshot, MoE bf16 grouped_mm, DDP compression hooks on NCCL)"
  echo "skipped (--dry-run)" > "$OUT/cuda-paths.txt"
else
  : > "$OUT/cuda-paths.txt"
  if tb run --no-check "$repo/recipes/tiny-shakespeare.toml" run.device=cuda data.pin_memory=true train.max_steps=20 \
       train.eval_every=10 --run-dir "$work/pinned" >>"$OUT/suite.log" 2>&1; then
    echo "pinned-memory loader: ok (20 steps)" >> "$OUT/cuda-paths.txt"
  else
    echo "pinned-memory loader: FAILED" >> "$OUT/cuda-paths.txt"
  fi
  if (cd "$work" && "$py" "$repo/benchmarks/accelerator_nccl.py" "$OUT/flight") >> "$OUT/cuda-paths.txt" 2>>"$OUT/suite.log"; then :
  else echo "nccl + flight recorder: FAILED" >> "$OUT/cuda-paths.txt"; fi
  TRAINBOOK_FAULT=model.block_oom@2 tb run --no-check "$repo/recipes/tiny-shakespeare.toml" run.device=cuda \
    diagnose.memory_history=true train.max_steps=3 train.eval_every=0 --run-dir "$work/oom" >>"$OUT/suite.log" 2>&1 || true
  snap=$(ls "$work"/oom/oom/*.pickle 2>/dev/null | head -1 || true)
  if [[ -n $snap ]]; then
    cp "$snap" "$OUT/oom-snapshot.pickle"
    echo "oom memory snapshot: ok ($(basename "$snap"), $(stat -c %s "$snap") bytes)" >> "$OUT/cuda-paths.txt"
  else
    echo "oom memory snapshot: FAILED (none under oom/)" >> "$OUT/cuda-paths.txt"
  fi
  # The MoE recipe in bf16: torch._grouped_mm's CUDA kernel (sm90+; a loop of matmuls elsewhere),
  # the fp32 router and combine. Expert parallelism's NCCL all-to-all needs 2 GPUs: not on this one.
  if tb run --no-check "$repo/recipes/moe-tiny-shakespeare.toml" run.device=cuda precision.dtype=bf16 \
       train.max_steps=10 train.eval_every=0 --run-dir "$work/moe" >>"$OUT/suite.log" 2>&1; then
    echo "moe bf16 grouped_mm: ok (10 steps)" >> "$OUT/cuda-paths.txt"
  else
    echo "moe bf16 grouped_mm: FAILED" >> "$OUT/cuda-paths.txt"
  fi
  # parallel.grad_compression's hooks on the device over NCCL (one rank: the casts, PowerSGD's
  # matrix products and orthogonalisation on CUDA; each hook checked on known values first).
  if tb bench comm --grad-compression --nproc 1 --max-bytes 16MiB --iters 5 > "$work/hooks.txt" 2>>"$OUT/suite.log"; then
    echo "ddp compression hooks (nccl): ok ($(grep -c '^powersgd' "$work/hooks.txt") sizes)" >> "$OUT/cuda-paths.txt"
    cat "$work/hooks.txt" >> "$OUT/suite.log"
  else
    echo "ddp compression hooks (nccl): FAILED" >> "$OUT/cuda-paths.txt"
  fi
  cat "$OUT/cuda-paths.txt" | tee -a "$OUT/suite.log"
fi

# ---- the table ----------------------------------------------------------------------------------
"$py" "$repo/benchmarks/accelerator_table.py" "$OUT" | tee "$OUT/table.txt"
log "results in $OUT"
