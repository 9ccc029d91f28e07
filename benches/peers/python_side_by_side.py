#!/usr/bin/env python3
"""torch.distributed.rpc and Sluice's Python API side by side: same workloads, same machine,
one run, one process tree.

For each backend (``torch``: PyTorch RPC on TensorPipe; ``sluice``: ``sluice.rpc``) two
processes start with torchrun's variables; rank 0 measures, for a time budget each:
  - rpc_sync of a no-op (round trip p50 / p99),
  - rpc_async of the no-op with 64 calls in flight (calls per second),
  - rpc_sync echoing a torch uint8 tensor of 1 MiB and 64 MiB (GB/s = bytes / round trip,
    as `sluice bench rpc` counts its echo),
  - a parameter-server step: rank 1 holds a 1024x1024 f32 weight; the trainer fetches it,
    computes a gradient locally (batch 32) and pushes it back (microseconds per step).
With ``--rust BIN`` (the `sluice` binary) the Rust API's echo is measured in the same run
(`sluice bench rpc`), as the bar for the Python echo.

Prints JSON lines (`sluice bench --json` format, suite "python") and a table with ratios.

  python3 benches/peers/python_side_by_side.py --budget-s 2 --rust target/release/sluice
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

IN_FLIGHT = 64
SIZES = [1 << 20, 64 << 20]
WEIGHT = (1024, 1024)
BATCH = 32

rpc = None  # torch.distributed.rpc or sluice.rpc, set in worker()
STATE = {}


def noop():
    return None


def echo(t):
    return t


def ps_init():
    import torch

    torch.manual_seed(0)
    STATE["w"] = torch.randn(*WEIGHT) * 0.01


def ps_weights():
    return STATE["w"]


def ps_push(grad, lr):
    STATE["w"].sub_(grad, alpha=lr)
    return None


def percentile(s, q):
    return s[round((len(s) - 1) * q)]


def timed(budget_s, call, at_least=5):
    samples = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or len(samples) < at_least:
        t0 = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t0)
    return sorted(samples[1:] if len(samples) > 3 else samples)


def emit(backend, metric, **fields):
    r = {"suite": "python", "backend": backend, "metric": metric, "baseline": ""}
    r.update(fields)
    print(json.dumps(r), flush=True)


def drive(name, budget_s):
    import torch

    rtts = timed(budget_s, lambda: rpc.rpc_sync("callee", noop))
    emit(f"{name}/rpc_sync-noop", "rtt", bytes=0, p50_ns=percentile(rtts, 0.5), p99_ns=percentile(rtts, 0.99),
         iterations=len(rtts))

    done, start = 0, time.perf_counter()
    window = [rpc.rpc_async("callee", noop) for _ in range(IN_FLIGHT)]
    while time.perf_counter() - start < budget_s:
        window.pop(0).wait()
        window.append(rpc.rpc_async("callee", noop))
        done += 1
    for f in window:
        f.wait()
    done += len(window)
    elapsed = time.perf_counter() - start
    emit(f"{name}/rpc_async-64", "rate", bytes=0, per_second=done / elapsed, iterations=done)

    for size in SIZES:
        t = torch.ones(size, dtype=torch.uint8)
        samples = timed(budget_s, lambda: rpc.rpc_sync("callee", echo, (t,)))
        mean = sum(samples) / len(samples)
        emit(f"{name}/rpc-echo", "bw", bytes=size, gbps=size / mean, p50_ns=percentile(samples, 0.5),
             iterations=len(samples))

    rpc.rpc_sync("callee", ps_init)
    x = torch.randn(BATCH, WEIGHT[1])

    def step():
        w = rpc.rpc_sync("callee", ps_weights)
        y = x @ w.t()
        grad = (2.0 / BATCH) * (y.t() @ x)  # d/dw of mean(y * y) summed over outputs
        rpc.rpc_sync("callee", ps_push, (grad, 1e-3))

    steps = timed(budget_s, step)
    emit(f"{name}/ps-step", "rtt", bytes=WEIGHT[0] * WEIGHT[1] * 4, p50_ns=percentile(steps, 0.5),
         p99_ns=percentile(steps, 0.99), iterations=len(steps))


def worker(backend, budget_s):
    global rpc
    rank = int(os.environ["RANK"])
    name = "caller" if rank == 0 else "callee"
    if backend == "torch":
        import torch.distributed.rpc as r

        rpc = r
        rpc.init_rpc(name, rank=rank, world_size=2,
                     rpc_backend_options=r.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120))
    else:
        import sluice.rpc as r

        rpc = r
        rpc.init_rpc(name, rank=rank, world_size=2, options=r.RpcBackendOptions(rpc_timeout=120))
    if rank == 0:
        drive(backend, budget_s)
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(backend, budget_s):
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", backend,
                                       "--budget-s", str(budget_s)], env=env, stdout=subprocess.PIPE, text=True))
    out, _ = procs[0].communicate(timeout=600)
    procs[1].wait(timeout=600)
    if procs[0].returncode or procs[1].returncode:
        sys.exit(f"the {backend} group failed ({procs[0].returncode}, {procs[1].returncode})")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def rust_echo(binary):
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        subprocess.run([binary, "bench", "rpc", "--json", f.name], check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in open(f.name)]
    out = []
    for r in records:
        if r["backend"].startswith("rpc-echo/") and r["backend"].endswith("/shm"):
            out.append({"suite": "python", "backend": "rust/rpc-echo", "metric": "bw", "bytes": r["bytes"],
                        "gbps": r["gbps"], "iterations": r["iterations"], "baseline": ""})
        if r["backend"].startswith("rpc_sync-noop/") and r["backend"].endswith("/shm"):
            out.append({"suite": "python", "backend": "rust/rpc_sync-noop", "metric": "rtt", "bytes": 0,
                        "p50_ns": r["p50_ns"], "p99_ns": r["p99_ns"], "iterations": r["iterations"], "baseline": ""})
    return out


def table(records):
    by = {(r["backend"], r.get("bytes", 0)): r for r in records}

    def get(backend, size=0):
        return by.get((backend, size))

    rows = ["| workload | torch.distributed.rpc | sluice (Python) | ratio | Rust API |", "|---|---|---|---|---|"]
    t, s, rs = get("torch/rpc_sync-noop"), get("sluice/rpc_sync-noop"), get("rust/rpc_sync-noop")
    rows.append(f"| rpc_sync no-op, p50 | {t['p50_ns'] / 1e3:.1f} µs | {s['p50_ns'] / 1e3:.1f} µs | "
                f"**{t['p50_ns'] / s['p50_ns']:.1f}× faster** | {rs['p50_ns'] / 1e3:.2f} µs |" if rs else
                f"| rpc_sync no-op, p50 | {t['p50_ns'] / 1e3:.1f} µs | {s['p50_ns'] / 1e3:.1f} µs | "
                f"**{t['p50_ns'] / s['p50_ns']:.1f}× faster** | |")
    t, s = get("torch/rpc_async-64"), get("sluice/rpc_async-64")
    rows.append(f"| rpc_async, 64 in flight | {t['per_second']:,.0f}/s | {s['per_second']:,.0f}/s | "
                f"**{s['per_second'] / t['per_second']:.1f}×** | |")
    for size in SIZES:
        t, s, rs = get("torch/rpc-echo", size), get("sluice/rpc-echo", size), get("rust/rpc-echo", size)
        rust = f"{rs['gbps']:.2f} GB/s (Python {s['gbps'] / rs['gbps']:.2f}×)" if rs else ""
        rows.append(f"| tensor echo {size >> 20} MiB | {t['gbps']:.2f} GB/s | {s['gbps']:.2f} GB/s | "
                    f"**{s['gbps'] / t['gbps']:.1f}×** | {rust} |")
    t, s = get("torch/ps-step", WEIGHT[0] * WEIGHT[1] * 4), get("sluice/ps-step", WEIGHT[0] * WEIGHT[1] * 4)
    rows.append(f"| parameter-server step (4 MiB weight) | {t['p50_ns'] / 1e3:.0f} µs | {s['p50_ns'] / 1e3:.0f} µs | "
                f"**{t['p50_ns'] / s['p50_ns']:.1f}× faster** | |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=2.0)
    p.add_argument("--rust", help="the sluice binary, to measure the Rust API's echo in the same run")
    p.add_argument("--backends", default="torch,sluice")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.budget_s)
    records = []
    for backend in a.backends.split(","):
        records += run_group(backend, a.budget_s)
    if a.rust:
        records += rust_echo(a.rust)
    for r in records:
        print(json.dumps(r))
    if {"torch", "sluice"} <= set(a.backends.split(",")):
        print()
        print(table(records))


if __name__ == "__main__":
    main()
