"""Where the absent-GPU crash happens (issue 33): on one H200 with torch 2.11+cu130, a worker
whose device map names a GPU the machine lacks died with SIGSEGV in `init_rpc`, where the CPU
build raises. Reading the code found nothing on the constructor's path that can fault (the
check throws before any CUDA call but `deviceCount`, and before the C library is reached), so
this separates the candidates, each case in a process of its own:

- every exception leaving `_C.SluiceAgent` crashes on that build (`name` crashes too);
- any C++ exception crashes once CUDA/NVML are initialised (`torch-nvml` crashes too);
- the crash is at exit, not in the call (`CAUGHT`, then a signal; the `-exit` cases clean).

Informative only: prints each case's exit status and last lines, and always exits 0.
`scripts/gpu-check.sh` runs it after `cuda_check.py`. On a machine without a GPU every case
is caught (the maps name CUDA devices there is none of).

Run: PYTHONPATH=<where sluice_torch is installed> python3 absent_gpu_diagnose.py
"""

import os
import subprocess
import sys
import tempfile

CASES = ["name", "dev", "self", "self-t1", "self-nvml", "self-ctx", "self-nvml-exit", "torch-nvml", "rpc-nvml", "rpc-nvml-exit"]


def case(c):
    import torch
    import torch.distributed as dist
    from torch.distributed import rpc

    import sluice_torch
    from sluice_torch import _C

    if "nvml" in c:
        print("device_count", torch.cuda.device_count(), flush=True)
    if "ctx" in c:
        torch.zeros(1, device="cuda:0")
    try:
        if c.startswith("torch"):
            torch.zeros(1, device="cuda:1")
        elif c.startswith("rpc"):
            opts = sluice_torch.SluiceRpcBackendOptions(
                init_method="file://" + tempfile.mktemp(prefix="sluice-diag-"), device_maps={"worker0": {0: 1}}
            )
            rpc.init_rpc("worker0", rank=0, world_size=1, backend=sluice_torch.BACKEND, rpc_backend_options=opts)
        else:
            maps, devices = {}, []
            if c.startswith("self"):
                maps = {"w0": {"cuda:0": "cuda:1"}}
            if c.startswith("dev"):
                devices = ["cuda:1"]
            if c.startswith("name"):
                maps = {"nobody": {"cuda:0": "cuda:0"}}
            threads = 1 if "t1" in c else 4
            _C.SluiceAgent(dist.HashStore(), "w0", 0, 1, 60.0, threads, "", "", "127.0.0.1", "segment_bytes=0", maps, devices)
        print("NO ERROR", flush=True)
    except Exception as e:  # the point is to see what comes back
        print("CAUGHT", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", flush=True)
    if "exit" in c:
        os._exit(0)
    print("RETURNING", flush=True)


def main():
    if len(sys.argv) > 1:
        case(sys.argv[1])
        return
    for c in CASES:
        try:
            p = subprocess.run(
                [sys.executable, "-X", "faulthandler", __file__, c], capture_output=True, text=True, timeout=120
            )
            rc, out = p.returncode, (p.stdout + p.stderr).strip().splitlines()
        except subprocess.TimeoutExpired:
            rc, out = "timeout", []
        print(f"absent_gpu_diagnose: {c}: rc={rc} (-11 is SIGSEGV)", flush=True)
        for line in out[-6:]:
            print(f"    {line}", flush=True)


if __name__ == "__main__":
    main()
