"""PyTorch's Gloo allreduce, the baseline of `sluice bench collective`: float32 allreduce (sum)
of each size on 2 and 4 processes of this host, the same iteration counts as Sluice's suite,
each call timed on rank 0. Prints one JSON record per (world, size) in `sluice bench`'s format."""

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def iterations(size, quick):
    n = max(5, min(200, (256 << 20) // max(size, 1)))
    return max(5, n // 4) if quick else n


def worker(rank, world, port, sizes, quick):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(2):
            dist.all_reduce(t)
        samples = []
        for _ in range(iterations(size, quick)):
            t0 = time.perf_counter_ns()
            dist.all_reduce(t)
            samples.append(time.perf_counter_ns() - t0)
        if rank == 0:
            samples.sort()
            pick = lambda q: samples[round((len(samples) - 1) * q)]
            print(json.dumps({"suite": "peer", "backend": f"gloo-allreduce-f32-{world}p", "metric": "rtt",
                              "bytes": size, "p50_ns": pick(0.5), "p99_ns": pick(0.99),
                              "iterations": len(samples), "baseline": ""}), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="4096,1048576")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    for world in [int(w) for w in a.worlds.split(",") if w]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(world, port, sizes, a.quick), nprocs=world)


if __name__ == "__main__":
    main()
