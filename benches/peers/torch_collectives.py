"""torch.distributed's collectives, beside `sluice bench collective`: float32 allreduce (sum),
allgather, broadcast and reduce-scatter of each size (the whole buffer: allgather's output,
reduce-scatter's input) on 2 and 4 processes of this host through each process-group backend asked for
(PyTorch's Gloo; Sluice's "sluice" when sluice_torch is importable), the same iteration counts
as Sluice's own suite, each call timed on rank 0; and, with --ddp, a data-parallel training step
(Linear(1024, 1024), batch 32, SGD) on 2 processes: without DDP, under DDP with a comm hook that
communicates nothing (DDP's own cost: the floor for any backend), and under DDP on each backend,
in alternating turns. Prints one JSON record per row in `sluice bench`'s format."""

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


def emit(backend, size, samples, rank):
    if rank != 0:
        return
    samples = sorted(samples)
    pick = lambda q: samples[round((len(samples) - 1) * q)]
    print(json.dumps({"suite": "peer", "backend": backend, "metric": "rtt", "bytes": size, "p50_ns": pick(0.5),
                      "p99_ns": pick(0.99), "iterations": len(samples), "baseline": ""}), flush=True)


# Each collective on a whole buffer of `size` bytes (allgather's output, reduce-scatter's input)
# and a rank's piece of it, as `sluice bench collective` names its rows.
OPS = {
    "allreduce": lambda whole, piece, g: dist.all_reduce(whole, group=g),
    "allgather": lambda whole, piece, g: dist.all_gather_into_tensor(whole, piece, group=g),
    "broadcast": lambda whole, piece, g: dist.broadcast(whole, src=0, group=g),
    "reducescatter": lambda whole, piece, g: dist.reduce_scatter_tensor(piece, whole, group=g),
}


def collectives(rank, world, sizes, quick, backends):
    for name in backends:
        group = dist.new_group(backend=name)
        tag = "gloo" if name == "gloo" else f"torch-{name}"
        for op, fn in OPS.items():
            for size in sizes:
                whole = torch.ones(size // 4, dtype=torch.float32)
                piece = torch.ones(size // 4 // world, dtype=torch.float32)
                for _ in range(2):
                    fn(whole, piece, group)
                samples = []
                for _ in range(iterations(size, quick)):
                    t0 = time.perf_counter_ns()
                    fn(whole, piece, group)
                    samples.append(time.perf_counter_ns() - t0)
                emit(f"{tag}-{op}-f32-{world}p", size, samples, rank)
        dist.destroy_process_group(group)


def no_communication(_state, bucket):
    """A DDP comm hook that communicates nothing: DDP's own cost, the floor for any backend."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def ddp(rank, world, quick, backends):
    torch.manual_seed(0)
    groups = {name: dist.new_group(backend=name) for name in backends}
    models = {"none": torch.nn.Linear(1024, 1024)}
    for name, group in [("no-communication", groups[backends[0]])] + list(groups.items()):
        m = torch.nn.Linear(1024, 1024)
        m.load_state_dict(models["none"].state_dict())
        models[name] = torch.nn.parallel.DistributedDataParallel(m, process_group=group)
        if name == "no-communication":
            models[name].register_comm_hook(None, no_communication)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x, y = torch.randn(32, 1024), torch.randn(32, 1024)
    samples = {k: [] for k in models}
    steps = 10 if quick else 40
    for turn in range(4):
        for k, m in models.items():
            dist.barrier(group=groups[backends[0]])
            for i in range(steps + 2):
                t0 = time.perf_counter_ns()
                opts[k].zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                opts[k].step()
                if i >= 2:
                    samples[k].append(time.perf_counter_ns() - t0)
    params = sum(p.numel() * 4 for p in models["none"].parameters())
    for k, s in samples.items():
        emit(f"ddp-step-{k}", params, s, rank)


def worker(rank, world, port, sizes, quick, backends, with_ddp):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if "sluice" in backends:
        import sluice_torch  # noqa: F401  (registers the "sluice" process group)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    collectives(rank, world, sizes, quick, backends)
    if with_ddp:
        ddp(rank, world, quick, backends)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="4096,1048576")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--backends", default="gloo", help="comma-separated: gloo, sluice")
    p.add_argument("--ddp", action="store_true", help="also the DDP step, on 2 processes")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s]
    backends = [b for b in a.backends.split(",") if b]
    for world in [int(w) for w in a.worlds.split(",") if w]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(world, port, sizes, a.quick, backends, a.ddp and world == 2), nprocs=world)


if __name__ == "__main__":
    main()
