#!/usr/bin/env bash
# Sluice under PyTorch: builds sluice-torch (the SLUICE torch.distributed.rpc backend and the
# "sluice" process group) against the torch in the virtual environment (target/pyenv, made by
# python-check.sh or here), runs their own tests, then PyTorch's generic RPC suites against it.
#
#   scripts/torch-check.sh          # the backend's tests and the CI subset of PyTorch's suites
#   scripts/torch-check.sh full     # ... and every test of PyTorch's GENERIC_TESTS (about 50 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pyenv.sh
# The torch this backend is written for (python/torch/setup.py: SUPPORTED), and what PyTorch's
# test modules import (expecttest, hypothesis).
TORCH="torch==2.15.*"
"$VENV/bin/python" -c 'import sys, torch, pytest, expecttest, hypothesis; sys.exit(not torch.__version__.startswith("2.15."))' 2>/dev/null \
    || "$VENV/bin/python" -m pip install --quiet "$TORCH" pytest expecttest hypothesis

# Building without isolation uses the venv's setuptools (70.1 and later build wheels themselves).
"$VENV/bin/python" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 71)' 2>/dev/null \
    || "$VENV/bin/python" -m pip install --quiet "setuptools>=71"

# What the README says: built against the torch already installed, in one command.
"$VENV/bin/python" -m pip install --quiet --no-build-isolation ./python/torch

cd python/torch/tests
"$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider test_backend.py test_process_group.py test_dynamic.py
"$VENV/bin/python" run_generic.py "${1:-ci}"
