"""The "sluice" process group across real processes: every collective against a reference
computed locally, across dtypes, reduce ops and sizes (0, 1, odd, ring-sized); DDP on "sluice"
against DDP on "gloo" (gradients bitwise equal); two groups over the same ranks; clear errors
for tensors it cannot carry and for sizes that differ across ranks; a killed rank failing the
others naming it.

    python -m pytest -q python/torch/tests/test_process_group.py
"""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import sluice_torch
from procs import run

# Sizes (elements): empty, one, odd, and past the direct algorithm's 64 KiB (the ring).
SIZES = [0, 1, 7, 40_003]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8, torch.uint8]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]


def init(rank, world, method, timeout_s=60):
    dist.init_process_group(
        "sluice", init_method=method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def value(rank, n, dtype, op):
    """Rank `rank`'s input: small integers, so every reduction order gives the same exact answer
    (products stay in range: 1s and 2s)."""
    i = torch.arange(n, dtype=torch.int64)
    if op == dist.ReduceOp.PRODUCT:
        v = 1 + (i + rank) % 2
    else:
        v = (i * 7 + rank * 3) % 11 + (1 if dtype == torch.uint8 else -5 if dtype.is_signed else 0)
    return v.to(dtype)


def reference(world, n, dtype, op):
    vals = torch.stack([value(r, n, dtype, op).double() for r in range(world)])
    if op == dist.ReduceOp.SUM:
        out = vals.sum(0)
    elif op == dist.ReduceOp.AVG:
        out = vals.sum(0) / world
    elif op == dist.ReduceOp.PRODUCT:
        out = vals.prod(0)
    elif op == dist.ReduceOp.MIN:
        out = vals.min(0).values
    else:
        out = vals.max(0).values
    return out.to(dtype)


def applies(dtype, op):
    return op != dist.ReduceOp.AVG or dtype.is_floating_point


def _collectives(rank, world, method):
    init(rank, world, method)
    assert dist.get_backend() == "sluice"
    assert dist.get_rank() == rank and dist.get_world_size() == world
    checked = 0
    for dtype in DTYPES:
        for op in OPS:
            if not applies(dtype, op):
                continue
            for n in SIZES:
                t = value(rank, n, dtype, op)
                dist.all_reduce(t, op=op)
                want = reference(world, n, dtype, op)
                if op == dist.ReduceOp.AVG:
                    torch.testing.assert_close(t.double(), want.double(), rtol=1e-2, atol=1e-2)
                else:
                    assert torch.equal(t, want), (dtype, op, n, t[:8], want[:8])
                # reduce to a root other than 0, and reduce_scatter_tensor, on the same data.
                t = value(rank, n, dtype, op)
                dist.reduce(t, dst=world - 1, op=op)
                if rank == world - 1 and op != dist.ReduceOp.AVG:
                    assert torch.equal(t, want), ("reduce", dtype, op, n)
                if n > 0 and op != dist.ReduceOp.AVG:
                    full = torch.cat([value(rank, n, dtype, op)] * world)
                    out = torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(out, full, op=op)
                    assert torch.equal(out, want), ("reduce_scatter_tensor", dtype, op, n)
                checked += 1
    assert checked > 100
    # Reductions on bool (MAX is "any", MIN is "all").
    b = torch.tensor([rank == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    assert b.tolist() == [True, True, False]

    for n in SIZES:
        mine = torch.arange(n, dtype=torch.float32) + 1000 * rank
        # broadcast from the last rank
        t = mine.clone()
        dist.broadcast(t, src=world - 1)
        assert torch.equal(t, torch.arange(n, dtype=torch.float32) + 1000 * (world - 1))
        # all_gather into a list and into one tensor
        outs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, mine)
        for r in range(world):
            assert torch.equal(outs[r], torch.arange(n, dtype=torch.float32) + 1000 * r)
        flat = torch.empty(world * n)
        dist.all_gather_into_tensor(flat, mine)
        assert torch.equal(flat, torch.cat(outs))
        # in place: the input is this rank's piece of the output
        flat2 = torch.zeros(world * n)
        flat2[rank * n : (rank + 1) * n] = mine
        dist.all_gather_into_tensor(flat2, flat2[rank * n : (rank + 1) * n])
        assert torch.equal(flat2, flat)
        # gather to rank 1, scatter from rank 0
        gl = [torch.empty(n) for _ in range(world)] if rank == 1 else None
        dist.gather(mine, gather_list=gl, dst=1)
        if rank == 1:
            assert torch.equal(torch.cat(gl), flat)
        got = torch.empty(n)
        dist.scatter(got, scatter_list=[torch.full((n,), float(r)) for r in range(world)] if rank == 0 else None, src=0)
        assert torch.equal(got, torch.full((n,), float(rank)))
        # reduce_scatter with lists
        out = torch.empty(n)
        dist.reduce_scatter(out, [torch.full((n,), float(rank + r)) for r in range(world)])
        assert torch.equal(out, torch.full((n,), float(sum(q + rank for q in range(world)))))

    # all_to_all_single: even, and uneven (rank i sends i + j + 1 rows to rank j)
    src = torch.arange(world * 4, dtype=torch.int64) + 100 * rank
    dst = torch.empty_like(src)
    dist.all_to_all_single(dst, src)
    assert dst.tolist() == [100 * i + rank * 4 + k for i in range(world) for k in range(4)]
    send = [rank + j + 1 for j in range(world)]
    recv = [i + rank + 1 for i in range(world)]
    src = torch.cat([torch.full((s, 2), 10 * rank + j) for j, s in enumerate(send)])
    dst = torch.empty(sum(recv), 2, dtype=src.dtype)
    dist.all_to_all_single(dst, src, output_split_sizes=recv, input_split_sizes=send)
    assert torch.equal(dst, torch.cat([torch.full((s, 2), 10 * i + rank) for i, s in enumerate(recv)]))
    # all_to_all with lists of different sizes
    ins = [torch.full((j + 1,), float(rank)) for j in range(world)]
    outs = [torch.empty(rank + 1) for _ in range(world)]
    dist.all_to_all(outs, ins)
    assert [o.tolist() for o in outs] == [[float(i)] * (rank + 1) for i in range(world)]

    # point to point with tags, blocking and not, around the ring
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    reqs = [dist.isend(torch.full((5,), float(rank * 10 + tag)), nxt, tag=tag) for tag in (1, 2)]
    b2, b1 = torch.empty(5), torch.empty(5)
    dist.recv(b2, src=prv, tag=2)
    r1 = dist.irecv(b1, src=prv, tag=1)
    r1.wait()
    for r in reqs:
        r.wait()
    assert b1.tolist() == [prv * 10 + 1.0] * 5 and b2.tolist() == [prv * 10 + 2.0] * 5
    # batch_isend_irecv (what torch.distributed.pipelining uses)
    big = torch.arange(300_000, dtype=torch.float32) + rank
    into = torch.empty_like(big)
    ops = [dist.P2POp(dist.isend, big, nxt), dist.P2POp(dist.irecv, into, prv)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert torch.equal(into, torch.arange(300_000, dtype=torch.float32) + prv)

    # async collectives: a Work, its future's value is the tensors
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    fut_value = work.get_future().wait()
    assert work.is_completed() and work.is_success()
    assert torch.equal(fut_value[0], torch.full((3,), float(world)))
    dist.barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.destroy_process_group()


def test_every_collective_matches_a_reference():
    run(_collectives, 3)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _ddp(rank, world, method):
    init(rank, world, method)
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    base = Net()
    models = {}
    for name, pg in [("sluice", None), ("gloo", gloo)]:
        m = Net()
        m.load_state_dict(base.state_dict())
        # A small bucket cap: several buckets, reduced while backward is still running.
        models[name] = torch.nn.parallel.DistributedDataParallel(m, process_group=pg, bucket_cap_mb=0.05)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(5):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        grads = {}
        for k, m in models.items():
            opts[k].zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            grads[k] = [p.grad.clone() for p in m.parameters()]
            opts[k].step()
        for a, b in zip(grads["sluice"], grads["gloo"]):
            # Two ranks: every element is a + b in either backend, so the bytes agree.
            assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"
    # Replicas stay identical across ranks.
    flat = torch.cat([p.detach().reshape(-1) for p in models["sluice"].parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], e) for e in everyone)
    dist.destroy_process_group()


def test_ddp_on_sluice_matches_ddp_on_gloo():
    run(_ddp, 2)


def _fsdp(rank, world, method):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init(rank, world, method)
    meshes = {"sluice": init_device_mesh("cpu", (world,)), "gloo": DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")}
    models, opts = {}, {}
    for name, mesh in meshes.items():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        models[name] = fully_shard(m, mesh=mesh)
        opts[name] = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(8, 16, generator=g)
        for name, m in models.items():
            opts[name].zero_grad()
            m(x).pow(2).mean().backward()
            opts[name].step()
    # Sharded parameters, all-gathered back whole: the same bytes through either backend.
    for a, b in zip(models["sluice"].parameters(), models["gloo"].parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    dist.destroy_process_group()


def test_fsdp_on_sluice_matches_fsdp_on_gloo():
    run(_fsdp, 2)


def _pipelining(rank, world, method):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    init(rank, world, method)
    groups = {"sluice": None, "gloo": dist.new_group(backend="gloo")}
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    results = {}
    for name, group in groups.items():
        torch.manual_seed(0)
        a, b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        mod = torch.nn.Sequential(a, torch.nn.ReLU()) if rank == 0 else torch.nn.Sequential(b)
        stage = PipelineStage(mod, rank, world, torch.device("cpu"), group=group)
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        results[name] = ([l.detach() for l in losses], [p.grad.clone() for p in mod.parameters()])
    # Activations forward and gradients back through batch_isend_irecv: the same numbers.
    for want, got in zip(results["gloo"], results["sluice"]):
        assert len(want) == len(got) and all(torch.equal(w, g) for w, g in zip(want, got))
    dist.destroy_process_group()


def test_pipelining_on_sluice_matches_pipelining_on_gloo():
    run(_pipelining, 2)


def _two_groups(rank, world, method):
    init(rank, world, method)
    a = dist.new_group(backend="sluice")
    b = dist.new_group(backend="sluice")
    for i in range(20):
        ta, tb = torch.full((100,), float(rank + i)), torch.full((70_000,), float(rank * 2 + i))
        wa = dist.all_reduce(ta, group=a, async_op=True)
        wb = dist.all_reduce(tb, group=b, async_op=True)
        wb.wait()
        wa.wait()
        assert torch.equal(ta, torch.full((100,), float(sum(r + i for r in range(world)))))
        assert torch.equal(tb, torch.full((70_000,), float(sum(r * 2 + i for r in range(world)))))
    dist.destroy_process_group()


def test_two_groups_over_the_same_ranks_do_not_mix():
    run(_two_groups, 2)


def _errors(rank, world, method):
    init(rank, world, method, timeout_s=20)
    # Refused at the call on every rank, before anything is sent: nobody waits for it.
    with pytest.raises(RuntimeError, match="not contiguous"):
        dist.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(RuntimeError, match="reduce op"):
        dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.BAND)
    with pytest.raises(RuntimeError, match="dense"):
        dist.all_reduce(torch.ones(4).to_sparse())
    with pytest.raises(RuntimeError, match="any source"):
        dist.recv(torch.empty(1))
    with pytest.raises(RuntimeError, match="list of 2 tensors"):
        dist.all_gather([torch.empty(1)], torch.ones(1))
    with pytest.raises(RuntimeError, match="AVG on Int"):
        dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG)
    with pytest.raises(RuntimeError, match="conjugated"):
        dist.broadcast(torch.ones(2, dtype=torch.complex64).conj(), src=0)
    twice = torch.ones(8)
    with pytest.raises(RuntimeError, match="overlap"):
        dist.all_reduce_coalesced([twice, twice[2:5]])
    # Nothing above was sent: the group still works, and copies out under inference mode.
    with torch.inference_mode():
        outs = [torch.empty(2) for _ in range(world)]
        dist.all_gather(outs, torch.full((2,), float(rank)))
    assert [o.tolist() for o in outs] == [[float(r)] * 2 for r in range(world)]
    # Sizes that differ across ranks: an error in wait() on the ranks, never a hang.
    t = torch.ones(4 if rank == 0 else 6)
    with pytest.raises(RuntimeError, match="sizes differ"):
        dist.all_reduce(t)
    # A message longer than the receive buffer names both lengths.
    if rank == 0:
        dist.send(torch.ones(3), 1, tag=9)
    else:
        with pytest.raises(RuntimeError, match="12 bytes"):
            dist.recv(torch.empty(2), 0, tag=9)


def test_bad_tensors_and_mismatched_sizes_are_clear_errors():
    run(_errors, 2)


def _killed(rank, world, method):
    init(rank, world, method, timeout_s=60)
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == 2:
        os._exit(7)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2"):
        for _ in range(1000):
            dist.all_reduce(torch.ones(100_000))
    # Reported within seconds, not at the group's timeout.
    assert time.monotonic() - started < 20


def test_a_killed_rank_fails_the_others_naming_it():
    run(_killed, 3, expect_exit=[0, 0, 7])


def test_the_backend_is_registered():
    assert "SLUICE" in dist.Backend._plugins
    assert sluice_torch.PROCESS_GROUP == "sluice"
