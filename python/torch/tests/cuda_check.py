"""CUDA tensors through the SLUICE backend, on a GPU machine (run by scripts/gpu-check.sh; never
by CI, which has no GPU). Two processes on one GPU, device maps cuda:0 -> cuda:0 both ways:

- a request's CUDA tensor, produced by work still queued on a side stream when the call is
  made, arrives whole on the callee's mapped device, and the response comes back on the
  caller's device through the reverse map, ordered for the caller's current stream;
- CPU and CUDA tensors in one call; a 64 MiB tensor; an empty CUDA tensor;
- `remote` + `to_here` of a value made on the GPU;
- distributed autograd across the map (gradients back on the GPU);
- a CUDA tensor without a map is refused with TensorPipe's error text (the suites check it);
- a worker that names a GPU this machine lacks fails at init with the reason.

    python3 python/torch/tests/cuda_check.py     # exits 0 when every check passed
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.multiprocessing as mp
from torch.distributed import rpc

WATCHDOG_S = 240


def _opts(method, maps):
    import sluice_torch

    return sluice_torch.SluiceRpcBackendOptions(init_method=method, rpc_timeout=60, device_maps=maps)


def _double(x):
    return x * 2


def _make_on_gpu(n):
    return torch.arange(n, dtype=torch.float32, device="cuda:0")


def _worker(rank, world, method):
    import sluice_torch

    me, peer = f"worker{rank}", f"worker{1 - rank}"
    maps = {peer: {0: 0}} if rank == 0 else {}
    rpc.init_rpc(me, rank=rank, world_size=world, backend=sluice_torch.BACKEND, rpc_backend_options=_opts(method, maps))
    if rank == 0:
        dev = torch.device("cuda:0")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            # Queued, not finished, when the call is made: the send must wait for it.
            torch.cuda._sleep(50_000_000)
            x = torch.full((1 << 20,), 3.0, device=dev)
            y = rpc.rpc_sync(peer, _double, args=(x,))
            assert y.device == dev, y.device
            assert torch.equal(y.cpu(), torch.full((1 << 20,), 6.0)), "request and response ordered by streams"
        # CPU and CUDA tensors in one call; large; empty.
        a, b = torch.ones(3), torch.ones(3, device=dev)
        s = rpc.rpc_sync(peer, torch.add, args=(b, b))
        assert s.device == dev and torch.equal(s.cpu(), torch.full((3,), 2.0))
        c = rpc.rpc_sync(peer, torch.mul, args=(a, 5))
        assert c.device.type == "cpu" and torch.equal(c, torch.full((3,), 5.0))
        big = torch.randn(16 << 20, device=dev)
        assert torch.equal(rpc.rpc_sync(peer, torch.clone, args=(big,)), big)
        e = rpc.rpc_sync(peer, torch.clone, args=(torch.empty(0, 4, device=dev),))
        assert e.shape == (0, 4) and e.device == dev
        # An RRef to a value made on the callee's GPU.
        r = rpc.remote(peer, _make_on_gpu, args=(10,))
        v = r.to_here()
        assert v.device == dev and torch.equal(v.cpu(), torch.arange(10, dtype=torch.float32)), v
        # Distributed autograd across the map.
        with dist_autograd.context() as ctx:
            t = torch.ones(4, device=dev, requires_grad=True)
            loss = rpc.rpc_sync(peer, torch.mul, args=(t, 3.0)).sum()
            dist_autograd.backward(ctx, [loss])
            g = dist_autograd.get_gradients(ctx)[t]
            assert g.device == dev and torch.equal(g.cpu(), torch.full((4,), 3.0)), g
    else:
        # worker1 has no map to worker0: its own CUDA tensors cannot go there.
        try:
            rpc.rpc_sync("worker0", torch.add, args=(torch.ones(1, device="cuda:0"), 1))
        except RuntimeError as e:
            assert "TensorPipe RPC backend only supports CPU tensors by default" in str(e), e
        else:
            raise AssertionError("a CUDA tensor without a device map was sent")
    rpc.shutdown()


def _absent_gpu(rank, world, method):
    import sluice_torch

    missing = torch.cuda.device_count()
    opts = _opts(method, {"worker0": {0: missing}})
    try:
        rpc.init_rpc("worker0", rank=rank, world_size=world, backend=sluice_torch.BACKEND, rpc_backend_options=opts)
    except RuntimeError as e:
        assert f"cuda:{missing}" in str(e) and "GPU(s)" in str(e), e
    else:
        raise AssertionError(f"a map to cuda:{missing} was accepted")


def _entry(rank, fn, world, method):
    fn(rank, world, method)


def _run(fn, world):
    method = "file://" + tempfile.mktemp(prefix="sluice-cuda-")
    ctx = mp.start_processes(_entry, args=(fn, world, method), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + WATCHDOG_S
    # join() returns False each time one process ends while others still run (it raises if one
    # failed): go on until all have ended, or the watchdog.
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                p.kill()
            sys.exit(f"cuda_check: {fn.__name__} still running after {WATCHDOG_S} s (a hang)")
    print(f"cuda_check: {fn.__name__} passed", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("cuda_check: this machine has no GPU that torch can use")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _run(_worker, 2)
    _run(_absent_gpu, 1)
    print("cuda_check: every check passed")
