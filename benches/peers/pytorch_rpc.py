#!/usr/bin/env python3
"""PyTorch RPC (TensorPipe backend) on this host, for `sluice bench peers`.

Two processes: rank 0 calls, rank 1 answers. For a time budget each, rank 0 measures
  - rpc_sync of a no-op (round trip, p50/p99),
  - rpc_sync echoing a uint8 tensor of each size (round trip; bandwidth = 2 * size / rtt),
  - rpc_async of the no-op with 64 calls in flight (calls per second),
and prints one JSON object per result in the record format of `sluice bench --json`
(suite "peer").

  python3 pytorch_rpc.py --budget-ms 300 --sizes 64,1048576
"""
import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

IN_FLIGHT = 64


def noop():
    return None


def echo(t):
    return t


def emit(**fields):
    record = {"suite": "peer", "baseline": ""}
    record.update(fields)
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
             gbps=2.0 * size / p50, iterations=len(rtts))
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


def worker(rank, port, budget_s, sizes):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
    name = "caller" if rank == 0 else "callee"
    rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        caller(budget_s, sizes)
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-ms", type=float, default=300.0)
    parser.add_argument("--sizes", default="64,65536,1048576,67108864")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    mp.spawn(worker, args=(port, args.budget_ms / 1000.0, sizes), nprocs=2, join=True)


if __name__ == "__main__":
    sys.exit(main())
