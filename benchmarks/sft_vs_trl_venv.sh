#!/usr/bin/env bash
# The TRL side of benchmarks/sft_vs_trl.py runs in its own venv, so TRL's pins never touch the
# project's: benchmarks/.venv-trl (ignored by git). torch 2.13.0 resolves to the CPU build the
# project already uses. Usage: bash benchmarks/sft_vs_trl_venv.sh [PYTHON]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-trl"
python="${1:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --no-compile torch==2.13.0 'trl==1.16.*' 'peft==0.21.*' 'transformers>=5,<6' jinja2
"$venv/bin/python" -c "import torch, trl, peft, transformers; print('trl venv:', 'torch', torch.__version__, 'trl', trl.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)"
