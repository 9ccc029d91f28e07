#!/usr/bin/env python3
"""PyTorch RPC on this host, for `sluice bench peers`: the same program under PyTorch's own
TensorPipe backend (`--backend tensorpipe`, rows `pytorch-…`) and under Sluice's
(`--backend sluice`: `import sluice_torch`, rows `pytorch-sluice-…`), so the two compare like
with like.

Two processes: rank 0 calls, rank 1 answers. For a time budget each, rank 0 measures
  - rpc_sync of a no-op (round trip, p50/p99),
  - rpc_sync echoing a uint8 tensor of each size (round trip; bandwidth = size / rtt, the size
    counted once per round trip as Sluice's own echo rows count it),
  - rpc_async of the no-op with 64 calls in flight (calls per second),
  - remote of the no-op and to_here (round trip),
  - the training step of `sluice bench autograd`: Linear(1024, 1024) held by rank 1, batch
    32, loss mean(y * y), distributed autograd and DistributedOptimizer(SGD, lr 1e-3), and
    the same step in one process (microseconds per step),
and prints one JSON object per result in the record format of `sluice bench --json`
(suite "peer").

  python3 pytorch_rpc.py --budget-ms 300 --sizes 64,1048576 [--backend sluice]
"""
import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.optim import DistributedOptimizer

IN_FLIGHT = 64


def noop():
    return None


def echo(t):
    return t


LAYER = None


def make_layer():
    global LAYER
    torch.manual_seed(1)
    LAYER = nn.Linear(1024, 1024)
    return [rpc.RRef(p) for p in LAYER.parameters()]


def linear(x):
    return LAYER(x)


PREFIX = "pytorch"


def emit(**fields):
    record = {"suite": "peer", "baseline": ""}
    record.update(fields)
    record["backend"] = PREFIX + record["backend"][len("pytorch"):]
    print(json.dumps(record), flush=True)


def percentile(sorted_ns, q):
    return sorted_ns[round((len(sorted_ns) - 1) * q)]


def timed_calls(budget_s, call, at_least=5):
    samples = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or len(samples) < at_least:
        t0 = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t0)
    if len(samples) > 3:
        samples = samples[1:]  # the first call warms the path
    return sorted(samples)


def caller(budget_s, sizes):
    rtts = timed_calls(budget_s, lambda: rpc.rpc_sync("callee", noop))
    emit(backend="pytorch-rpc", metric="rtt", bytes=0, p50_ns=percentile(rtts, 0.5),
         p99_ns=percentile(rtts, 0.99), iterations=len(rtts))
    for size in sizes:
        t = torch.full((size,), 7, dtype=torch.uint8)
        rtts = timed_calls(budget_s, lambda: rpc.rpc_sync("callee", echo, args=(t,)))
        p50 = percentile(rtts, 0.5)
        emit(backend="pytorch-rpc-echo", metric="rtt", bytes=size, p50_ns=p50,
             p99_ns=percentile(rtts, 0.99), iterations=len(rtts))
        emit(backend="pytorch-rpc-echo", metric="bw", bytes=size,
             gbps=size / p50, iterations=len(rtts))
    window = []
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or done < 3:
        while len(window) < IN_FLIGHT:
            window.append(rpc.rpc_async("callee", noop))
        window.pop(0).wait()
        done += 1
    for f in window:
        f.wait()
    emit(backend="pytorch-rpc_async-64", metric="rate", bytes=0,
         per_second=done / (time.perf_counter() - start), iterations=done)
    rtts = timed_calls(budget_s, lambda: rpc.remote("callee", noop).to_here())
    emit(backend="pytorch-remote-to_here", metric="rtt", bytes=0, p50_ns=percentile(rtts, 0.5),
         p99_ns=percentile(rtts, 0.99), iterations=len(rtts))

    # The training step, locally, then with the layer on the callee.
    torch.manual_seed(1)
    local = nn.Linear(1024, 1024)
    opt = torch.optim.SGD(local.parameters(), lr=1e-3)
    x = torch.randn(32, 1024)

    def local_step():
        opt.zero_grad()
        y = local(x)
        (y * y).mean().backward()
        opt.step()

    for _ in range(3):
        local_step()
    steps = timed_calls(3 * budget_s, local_step)
    emit(backend="pytorch-local-step-linear1024-b32", metric="rtt", bytes=0,
         p50_ns=percentile(steps, 0.5), p99_ns=percentile(steps, 0.99), iterations=len(steps))
    params = rpc.rpc_sync("callee", make_layer)
    dopt = DistributedOptimizer(torch.optim.SGD, params, lr=1e-3)

    def dist_step():
        with dist_autograd.context() as ctx:
            y = rpc.rpc_sync("callee", linear, args=(x,))
            dist_autograd.backward(ctx, [(y * y).mean()])
            dopt.step(ctx)

    for _ in range(3):
        dist_step()
    steps = timed_calls(3 * budget_s, dist_step)
    emit(backend="pytorch-dist-step-linear1024-b32", metric="rtt", bytes=0,
         p50_ns=percentile(steps, 0.5), p99_ns=percentile(steps, 0.99), iterations=len(steps))


def worker(rank, port, budget_s, sizes, backend):
    global PREFIX
    torch.set_num_threads(1)  # as `sluice bench autograd`: one thread per process
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "sluice":
        import sluice_torch

        PREFIX = "pytorch-sluice"
        options = sluice_torch.SluiceRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
        chosen = sluice_torch.BACKEND
    else:
        options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
        chosen = rpc.BackendType.TENSORPIPE
    name = "caller" if rank == 0 else "callee"
    rpc.init_rpc(name, rank=rank, world_size=2, backend=chosen, rpc_backend_options=options)
    if rank == 0:
        caller(budget_s, sizes)
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-ms", type=float, default=300.0)
    parser.add_argument("--sizes", default="64,65536,1048576,67108864")
    parser.add_argument("--backend", choices=["tensorpipe", "sluice"], default="tensorpipe")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    mp.spawn(worker, args=(port, args.budget_ms / 1000.0, sizes, args.backend), nprocs=2, join=True)


if __name__ == "__main__":
    sys.exit(main())
