#!/usr/bin/env bash
# Sluice's Python package: builds and installs it into a virtual environment (target/pyenv),
# with NumPy and PyTorch (the CPU-capable wheel from the Python package index; no GPU needed),
# then runs the pytest suite (pipes and RPC across real processes).
#
#   scripts/python-check.sh                 # install and test
#   scripts/python-check.sh side-by-side    # also: torch.distributed.rpc vs sluice.rpc, one run
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pyenv.sh
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -c 'import torch, numpy, pytest, maturin' 2>/dev/null \
    || "$VENV/bin/python" -m pip install --quiet maturin pytest numpy torch

# What the README says: pip install ./python (maturin builds the extension, release profile).
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps ./python

# Run from outside the source tree so the installed package is what gets imported.
(cd python/tests && "$VENV/bin/python" -m pytest -q -rs .)

if [ "${1:-}" = "side-by-side" ]; then
    cargo build --release
    "$VENV/bin/python" benches/peers/python_side_by_side.py --budget-s 2 --rust target/release/sluice
fi
