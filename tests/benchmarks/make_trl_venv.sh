#!/usr/bin/env bash
# An isolated venv with TRL for tests/benchmarks/bench_grpo_vs_trl.py. It sees the system
# packages (torch, transformers, lightrft) and adds trl + accelerate on top, pinned so pip cannot
# replace torch or transformers. Never install trl into the system Python.
#
#   tests/benchmarks/make_trl_venv.sh [/tmp/trl-venv]
set -euo pipefail
VENV="${1:-/tmp/trl-venv}"
TRL_VERSION="${TRL_VERSION:-1.16.0}"  # needs transformers>=4.56.2, no torch pin; tested with 5.23 / 2.13
python -m venv --system-site-packages "$VENV"
CONSTRAINTS="$(mktemp)"
python - > "$CONSTRAINTS" <<'PY'
import torch, transformers
print(f"torch=={torch.__version__.split('+')[0]}")
print(f"transformers=={transformers.__version__}")
PY
"$VENV/bin/python" -m pip install "trl==$TRL_VERSION" -c "$CONSTRAINTS"
rm -f "$CONSTRAINTS"
"$VENV/bin/python" -c "import trl, torch, transformers; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
