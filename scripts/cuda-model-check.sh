#!/usr/bin/env bash
# Runs Sluice's GPU-gated suites against the CUDA driver model (cuda-model/), on any machine:
# no GPU, no NVIDIA driver. The model is loaded only because SLUICE_CUDA_DRIVER names it, and
# SLUICE_REQUIRE_GPU=1 turns every GPU test that would skip into a failure. Each pass runs once
# without delays and then with two seeds of random stream delays (SLUICE_CUDA_MODEL_SEED).
#
# What runs: the model's own tests (each rule fires); every signature Sluice declares and the
# model exports checked against NVIDIA's cuda.h (scripts/cuda-abi-check.py); sluice-cuda's unit
# tests (probe, memory, pinned staging, IPC export, events) and the autograd crate's, but the two
# that check real NVRTC output (CI runs those with NVIDIA's NVRTC elsewhere); the channel crate's
# unit tests; the channel conformance suite's CUDA rows (cuda_ipc within a process and with a
# real peer process, cuda_p2p on two model devices and in loopback, cuda_staged) and
# tests/tests/cuda.rs; tests/tests/cuda_rpc.rs (device maps, RRefs on a GPU, a distributed
# backward across a map), cuda_autograd.rs (every op forward and backward against the CPU,
# training with each optimizer) and pipeline.rs (CUDA stages). Kernels run through the model's
# NVRTC stand-in (the host C++ compiler) and its cuBLAS stand-in: kernel logic and launch
# arguments are checked, not NVIDIA's code generation. Nothing here is a GPU figure: the bench
# refuses to measure under the model, and scripts/gpu-check.sh refuses to run under it.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p sluice-cuda-model
model="$PWD/target/release/libsluice_cuda_model.so"
cargo test --release -p sluice-cuda-model

# Sluice's declarations and the model's exports against NVIDIA's own headers: cuda.h and
# nvrtc.h from NVIDIA's wheels on PyPI (pinned; fetched once into target/cuda-header), and
# cublas_api.h where the project's venv has NVIDIA's cuBLAS wheel (torch brings it).
source scripts/pyenv.sh
fetch() { # WHEEL==VERSION, the header's path inside it
    local out="target/cuda-header/$(basename "$2")"
    if [ ! -s "$out" ]; then
        mkdir -p target/cuda-header
        "$VENV/bin/python" -m pip download --quiet --no-deps -d target/cuda-header "$1"
        "$VENV/bin/python" - "${1%%==*}" "$2" "$out" <<'PY'
import glob, sys, zipfile
wheel = glob.glob("target/cuda-header/" + sys.argv[1].replace("-", "_") + "-*.whl")[0]
open(sys.argv[3], "wb").write(zipfile.ZipFile(wheel).read(sys.argv[2]))
PY
    fi
}
fetch nvidia-cuda-runtime-cu12==12.9.79 nvidia/cuda_runtime/include/cuda.h
fetch nvidia-cuda-nvrtc-cu12==12.9.86 nvidia/cuda_nvrtc/include/nvrtc.h
cublas_h=$(find "$VENV"/lib/python3*/site-packages/nvidia -name cublas_api.h 2>/dev/null | head -1 || true)
python3 scripts/cuda-abi-check.py target/cuda-header/cuda.h target/cuda-header/nvrtc.h ${cublas_h:+"$cublas_h"}
[ -n "$cublas_h" ] || echo "cuda-abi-check: no cublas_api.h in $VENV (torch's NVIDIA wheels bring it): the cuBLAS stand-in's signatures were not checked"

# Every test below is GPU-gated or CUDA-specific, and none may skip: each pass logs its skips
# to its own file, which must stay empty. Left out by name: the checks of real NVRTC output
# (CI runs them with NVIDIA's NVRTC), the no-driver checks (they skip where a driver is), the
# GPUDirect rows (no RDMA transport here) and cuda_p2p loopback's peer-process row (loopback
# pairs a GPU with itself within one process).
skips="$PWD/target/cuda-model-skips.log"
run() { env SLUICE_CUDA_DRIVER="$model" SLUICE_REQUIRE_GPU=1 SLUICE_SKIP_LOG="$skips" \
    ${seed:+SLUICE_CUDA_MODEL_SEED=$seed} cargo test --release "$@"; }
for seed in "" 1 2; do
    # The last pass also makes pageable uploads synchronous (a driver may): nothing may mind.
    if [ "$seed" = 2 ]; then export SLUICE_CUDA_MODEL_PAGEABLE=sync; fi
    # cuda_ipc between processes waits for the peer's events on the host by default (one GPU,
    # two contexts); the middle pass makes those waits on the device instead, as under MPS.
    if [ "$seed" = 1 ]; then export SLUICE_CUDA_PEER_WAIT=device; else unset SLUICE_CUDA_PEER_WAIT; fi
    echo "== the CUDA driver model, seed ${seed:-none}${SLUICE_CUDA_MODEL_PAGEABLE:+, pageable copies synchronous}${SLUICE_CUDA_PEER_WAIT:+, peer waits on the device}"
    : >"$skips"
    run -p sluice-cuda --lib -- --skip nvrtc --skip without
    run -p sluice-channel --lib cuda
    run -p sluice-tests --test channel_conformance cuda_ -- --skip cuda_gdr --skip cuda_p2p_loopback::peer_process
    run -p sluice-tests --test cuda -- --skip without
    run -p sluice-autograd --lib -- --skip kernels_compile_and_take_the_arguments_launch_passes
    run -p sluice-tests --test cuda_rpc --test pipeline
    run -p sluice-tests --test cuda_autograd -- --skip without
    run -p sluice-capi --test gpu_tensors -- --skip without
    if [ -s "$skips" ]; then
        echo "== the CUDA driver model: tests skipped in this pass:" >&2
        cat "$skips" >&2
        exit 1
    fi
done
unset SLUICE_CUDA_MODEL_PAGEABLE SLUICE_CUDA_PEER_WAIT

# End to end: the parameter-server demo with its parameters on the (model's) GPU trains.
SLUICE_CUDA_DRIVER="$model" cargo run --release -q -- demo ps --gpu --epochs 30 | tee target/ps-gpu-model.log
grep -q "parameters on cuda:0 \[the CUDA driver model" target/ps-gpu-model.log
echo "== the CUDA driver model: every pass passed"
