"""What each worker of a test group does (run by _worker.py with torchrun's variables).

Rank 0 drives and asserts; the others serve until the graceful shutdown."""

import asyncio
import functools
import math
import operator
import os
import pickle
import threading
import time

import numpy as np
import torch

import rpcfns
from sluice import rpc


def _init(rank, **options):
    rpc.init_rpc(f"worker{rank}", options=rpc.RpcBackendOptions(**options) if options else None)


def calls(rank, world):
    _init(rank)
    if rank == 0:
        assert rpc.rpc_sync("worker1", rpcfns.add, (2, 3)) == 5
        assert rpc.rpc_sync(1, rpcfns.add, kwargs={"a": "x", "b": "y"}) == "xy"
        info = rpc.get_worker_info("worker1")
        assert info == rpc.WorkerInfo("worker1", 1) and rpc.get_worker_info().name == "worker0"
        assert rpc.rpc_sync(info, rpcfns.whoami) == "worker1"
        # Tensors anywhere in the arguments come back as their own types, with dtypes and
        # strides.
        t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()
        a = np.arange(10, dtype=np.uint16)[::3]
        args, kwargs = rpc.rpc_sync("worker1", rpcfns.echo, (t, [a, {"k": (t, 7)}]), {"b": torch.tensor(True)})
        assert isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bfloat16
        assert torch.equal(args[0], t) and args[0].stride() == t.stride()
        assert isinstance(args[1][0], np.ndarray) and np.array_equal(args[1][0], a)
        assert torch.equal(args[1][1]["k"][0], t) and args[1][1]["k"][1] == 7
        assert kwargs["b"].item() is True
        for dtype in (torch.float16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64, torch.uint8):
            x = (torch.arange(6) % 5).to(dtype)
            assert torch.equal(rpc.rpc_sync("worker1", rpcfns.scale, (x, 2)), x * 2)
        assert rpc.rpc_sync("worker1", rpcfns.numpy_stats, (np.ones(4, dtype=np.float32),)) == (1.0, "<f4")
        # A parameter that requires grad is sent detached.
        p = torch.nn.Parameter(torch.ones(3))
        assert torch.equal(rpc.rpc_sync("worker1", rpcfns.scale, (p, 3)), torch.full((3,), 3.0))
        # Large tensors.
        big = torch.randn(1 << 22)
        assert torch.equal(rpc.rpc_sync("worker1", rpcfns.scale, (big, 1)), big)
    rpc.shutdown()


def futures(rank, world):
    _init(rank)
    if rank == 0:
        f = rpc.rpc_async("worker1", rpcfns.add, (1, 1))
        assert f.wait() == 2 and f.done() and f.value() == 2
        g = rpc.rpc_async("worker1", rpcfns.add, (20, 1)).then(lambda fut: fut.wait() * 2)
        assert g.wait() == 42
        seen = []
        done = threading.Event()
        h = rpc.rpc_async("worker1", rpcfns.sleep, (0.1,))
        h.add_done_callback(lambda fut: (seen.append(fut.wait()), done.set()))
        assert done.wait(30) and seen == [0.1]
        many = [rpc.rpc_async("worker1", rpcfns.add, (i, i)) for i in range(200)]
        assert [m.wait() for m in many] == [2 * i for i in range(200)]
        failing = rpc.rpc_async("worker1", rpcfns.boom, ("async failure",))
        try:
            failing.wait()
            raise AssertionError("no exception")
        except ValueError as e:
            assert "async failure" in str(e)

        async def main():
            one = await rpc.rpc_async("worker1", rpcfns.add, (40, 2))
            both = await asyncio.gather(
                rpc.rpc_async("worker1", rpcfns.sleep, (0.05,)), rpc.rpc_async("worker1", rpcfns.add, (1, 2))
            )
            try:
                await rpc.rpc_async("worker1", rpcfns.boom, ("awaited",))
            except ValueError as e:
                return one, both, str(e)

        one, both, err = asyncio.run(main())
        assert one == 42 and both == [0.05, 3] and err == "awaited"
        # async_execution: the callee replies when the returned future completes.
        assert rpc.rpc_sync("worker1", rpcfns.doubled_later, (21,)) == 42
        assert rpc.rpc_sync("worker1", rpcfns.chained, ("worker0", 4)) == 50
        # 64 replies pending 1 s each: held on threads they would take 16 s on the pool's 4, or
        # (if the pool grew for them) add a thread each to the callee; holding none, they
        # overlap and the callee's thread count stays put.
        before = rpc.rpc_sync("worker1", rpcfns.os_threads)
        t0 = time.monotonic()
        slow = [rpc.rpc_async("worker1", rpcfns.doubled_later, (i, 1.0)) for i in range(64)]
        during = rpc.rpc_sync("worker1", rpcfns.os_threads)
        assert [s.wait() for s in slow] == [2 * i for i in range(64)]
        assert time.monotonic() - t0 < 8, time.monotonic() - t0
        assert during - before < 16, f"the callee grew from {before} to {during} threads"
        try:
            rpc.rpc_sync("worker1", rpcfns.fails_later)
            raise AssertionError("no exception")
        except RuntimeError as e:
            assert "failed asynchronously" in str(e)
    rpc.shutdown()


def rrefs(rank, world):
    _init(rank)
    if rank == 0:
        c = rpc.remote("worker1", rpcfns.Counter, (5,))
        assert c.owner() == rpc.WorkerInfo("worker1", 1) and c.owner_name() == "worker1" and not c.is_owner()
        assert c.rpc_sync().inc(3) == 8
        assert c.rpc_async().inc().wait() == 9
        assert c.to_here().n == 9
        derived = c.remote().get()
        assert derived.to_here() == 9
        # An RRef as an argument: worker2 reads through it from worker1.
        assert rpc.rpc_sync("worker2", rpcfns.fetch_via, (derived,)) == 9
        assert rpc.rpc_sync("worker2", rpcfns.sum_rref, (c,)) == 9
        # An RRef owned here.
        mine = rpc.RRef(torch.ones(3))
        assert mine.is_owner() and torch.equal(mine.local_value(), torch.ones(3))
        assert torch.equal(rpc.rpc_sync("worker1", rpcfns.fetch_via, (mine,)), torch.ones(3))
        # Methods that raise keep their type; the owner keeps serving.
        try:
            c.rpc_sync().fail()
            raise AssertionError("no exception")
        except KeyError as e:
            assert "no such counter" in str(e)
        assert c.rpc_sync().get() == 9
        # local_value elsewhere than the owner is an error naming the owner.
        try:
            c.local_value()
            raise AssertionError("no exception")
        except rpc.RpcError as e:
            assert "worker1" in str(e)
        # A remote whose constructor fails surfaces on use.
        bad = rpc.remote("worker1", rpcfns.boom, ("no value",))
        try:
            bad.to_here()
            raise AssertionError("no exception")
        except ValueError as e:
            assert "no value" in str(e)
        # A parameter server step: two trainers push gradients to a server object.
        ps = rpc.remote("worker1", rpcfns.ParameterServer, (4,))
        grads = [ps.rpc_async().push(torch.ones(4, dtype=torch.float64), 0.5) for _ in range(10)]
        for g in grads:
            g.wait()
        assert torch.equal(ps.rpc_sync().weights(), torch.full((4,), -5.0, dtype=torch.float64))
    if rank == 1:
        # The owner sees the object itself.
        pass
    rpc.shutdown()


def errors(rank, world):
    _init(rank)
    if rank == 0:
        try:
            rpc.rpc_sync("worker1", rpcfns.boom, ("bad input",))
            raise AssertionError("no exception")
        except ValueError as e:
            assert str(e).startswith("bad input")
            assert e.worker == "worker1"
            assert "rpcfns.py" in e.remote_traceback and "in boom" in e.remote_traceback
        try:
            rpc.rpc_sync("worker1", rpcfns.custom_boom)
            raise AssertionError("no exception")
        except rpcfns.CustomError as e:
            assert "survives the trip" in str(e)
        try:
            rpc.rpc_sync("worker1", rpcfns.key_error)
            raise AssertionError("no exception")
        except KeyError as e:
            assert "missing" in str(e)
        # A function only this worker can import.
        import only_here

        try:
            rpc.rpc_sync("worker1", only_here.hello)
            raise AssertionError("no exception")
        except RuntimeError as e:
            assert "cannot load the call" in str(e) and "only_here" in str(e)
        # Arguments that do not pickle fail here, before anything is sent.
        try:
            rpc.rpc_sync("worker1", rpcfns.echo, (lambda: 1,))
            raise AssertionError("no exception")
        except (AttributeError, TypeError, Exception) as e:
            assert "cannot pickle" in str(e)
        # A result that does not pickle is an error from the callee.
        try:
            rpc.rpc_sync("worker1", rpcfns.unpicklable_result)
            raise AssertionError("no exception")
        except rpc.RpcError as e:
            assert "pickle" in str(e)
        # Unknown worker.
        try:
            rpc.rpc_sync("worker9", rpcfns.noop)
            raise AssertionError("no exception")
        except rpc.RpcError as e:
            assert "worker9" in str(e)
        # A timeout, then the agent keeps serving.
        t0 = time.monotonic()
        try:
            rpc.rpc_sync("worker1", rpcfns.sleep, (3,), timeout=0.2)
            raise AssertionError("no exception")
        except rpc.RpcTimeout as e:
            assert isinstance(e, TimeoutError) and "worker1" in str(e)
        assert time.monotonic() - t0 < 2.5
        # A handler that blocks does not stall the others: one sleeps 2 s while 50 calls
        # complete.
        blocked = rpc.rpc_async("worker1", rpcfns.sleep, (2,))
        t0 = time.monotonic()
        for i in range(50):
            assert rpc.rpc_sync("worker1", rpcfns.add, (i, 1)) == i + 1
        assert time.monotonic() - t0 < 1.5, "calls waited for a blocked handler"
        assert blocked.wait() == 2
        # Tensors without DLPack are pickled like any object; objects that claim DLPack
        # and fail are clear errors.
        class NotATensor:
            def __dlpack__(self):
                return "not a capsule"

        try:
            rpc.rpc_sync("worker1", rpcfns.echo, (NotATensor(),))
            raise AssertionError("no exception")
        except TypeError as e:
            assert "capsule" in str(e)
        assert rpc.rpc_sync("worker1", rpcfns.add, (1, 1)) == 2
    rpc.shutdown()


def gil(rank, world):
    """While the main thread waits for a slow call, Python threads run (the GIL is released),
    and the callee serves other calls while one handler sleeps."""
    _init(rank)
    if rank == 0:
        ticks = [0]
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks[0] += 1

        th = threading.Thread(target=spin)
        th.start()
        time.sleep(0.05)
        before = ticks[0]
        rpc.rpc_sync("worker1", rpcfns.sleep, (0.5,))
        during = ticks[0] - before
        stop.set()
        th.join()
        assert during > 1000, f"only {during} ticks while waiting: the GIL was held"
    rpc.shutdown()


def options(rank, world):
    try:
        rpc.init_rpc(
            f"worker{rank}",
            options=rpc.RpcBackendOptions(device_maps={"worker1": {"cuda:0": "warp-drive"}}),
        )
        raise AssertionError("a bad device map was accepted")
    except ValueError as e:
        assert "device map" in str(e)
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=5, num_worker_threads=2, _transports=["tcp"])
    opts.set_device_map("worker1", {"cpu": "cpu"})
    rpc.init_rpc(f"worker{rank}", options=opts)
    if rank == 0:
        assert rpc._get_current_rpc_agent().default_timeout == 5
        assert rpc.rpc_sync("worker1", rpcfns.add, (2, 2)) == 4
    rpc.shutdown()


def remote_tensors(rank, world):
    """Remote tensors from Python: recorded on worker1, run there as one call, equal to NumPy;
    owner-to-owner moves from worker2; record-time errors; the supported dtypes."""
    _init(rank)
    if rank == 0:
        from sluice import remote

        x = np.arange(12, dtype=np.float64).reshape(3, 4) / 10
        w = np.linspace(-1, 1, 20).reshape(5, 4)
        xr, wr = remote.to(x, "worker1/cpu"), remote.to(w, "worker1/cpu")
        y = (xr.linear(wr).tanh() * 2 + 1).softmax(-1)
        assert y.is_pending() and y.shape == (3, 5) and y.dtype == np.float64
        assert y.placement == "worker1/cpu" and "recorded" in repr(y)
        z = np.tanh(x @ w.T) * 2 + 1
        expect = np.exp(z - z.max(-1, keepdims=True))
        expect /= expect.sum(-1, keepdims=True)
        np.testing.assert_allclose(y.to_here(), expect, rtol=1e-12)
        assert not y.is_pending()
        assert abs(xr.sum().item() - x.sum()) < 1e-12
        np.testing.assert_allclose(xr.mean(1, keepdim=True).to_here(), x.mean(1, keepdims=True), rtol=1e-12)
        np.testing.assert_allclose((1 - xr).to_here(), 1 - x, rtol=1e-12)
        np.testing.assert_allclose((xr @ wr.t()).to_here(), x @ w.T, rtol=1e-12)
        parts = remote.cat([xr.narrow(1, 2, 2), xr.narrow(1, 0, 2)], 0)
        np.testing.assert_array_equal(parts.to_here(), np.concatenate([x[:, 2:], x[:, :2]], 0))
        idx = np.array([[4, 0], [2, 2]], dtype=np.int64)
        np.testing.assert_array_equal(wr.embedding(remote.to(idx, "worker1/cpu")).to_here(), w[idx])
        cols = np.array([3, 0, 3], dtype=np.int64)
        np.testing.assert_array_equal(xr.index_select(1, remote.to(cols, "worker1/cpu")).to_here(), x[:, cols])
        pick = np.array([[2, 2, 0], [1, 0, 1], [0, 0, 2]], dtype=np.int64)
        np.testing.assert_array_equal(
            xr.gather(0, remote.to(pick, "worker1/cpu")).to_here(), np.take_along_axis(x[:, :3], pick, 0)
        )
        logits = np.array([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]])
        targets = np.array([0, 2], dtype=np.int64)
        ce = remote.to(logits, "worker1/cpu").cross_entropy(remote.to(targets, "worker1/cpu")).item()
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        assert abs(ce + logp[[0, 1], targets].mean()) < 1e-12
        # Owner to owner: b lives on worker2; the op on worker1 fetches it from there.
        b = remote.to(np.ones((3, 4)), "worker2/cpu")
        assert b.placement == "worker2/cpu"
        np.testing.assert_allclose((xr + b.to("worker1/cpu")).to_here(), x + 1, rtol=1e-12)
        np.testing.assert_allclose(xr.add(b).to_here(), x + 1, rtol=1e-12)
        # A 0-d array stays 0-d; results are writable arrays.
        s0 = remote.to(np.float64(2.5), "worker1/cpu")
        assert s0.shape == () and (s0 * 2).item() == 5.0
        got = xr.to_here()
        got[0, 0] = 7.0
        # A print is a flush point; torch tensors go in as arrays.
        assert "worker1/cpu" in str(xr * 2)
        t = remote.to(torch.ones(2, 2), "worker1/cpu")
        assert t.dtype == np.float32
        np.testing.assert_array_equal((t * 3).to_here(), np.full((2, 2), 3, np.float32))
        # Mistakes are ValueErrors where they are written, before anything is sent.
        for mistake in (
            lambda: xr.matmul(xr),
            lambda: xr.reshape(5, 5),
            lambda: xr.narrow(1, 3, 2),
            lambda: xr.gather(2, remote.to(pick, "worker1/cpu")),
            lambda: xr.index_select(0, remote.to(pick, "worker1/cpu")),
            lambda: remote.to(np.ones(2, dtype=np.int32), "worker1/cpu"),
            lambda: remote.to(x, "nobody/cpu"),
        ):
            try:
                mistake()
            except (ValueError, rpc.RpcError) as e:
                assert str(e), e
            else:
                raise AssertionError("a mistake was accepted")
        try:
            xr + 1j
        except TypeError:
            pass
        else:
            raise AssertionError("a complex scalar was accepted")
    rpc.shutdown()



def remote_training(rank, world):
    """Training from Python on remote parameters: a linear layer on worker1, trained two steps
    with SGD (once as backward then step, once with the step in the backward's answer), equal
    to the same steps in NumPy, its gradients read back from worker1; an optimizer over a tensor that is not a parameter, an integer
    parameter, and a backward or step in a context not entered or already left are clear
    errors."""
    _init(rank)
    if rank == 0:
        from sluice import remote

        rng = np.random.default_rng(3)
        x, w, b = rng.normal(size=(6, 4)), rng.normal(size=(3, 4)), rng.normal(size=3)
        wr, br = remote.parameter(w, "worker1/cpu", "w"), remote.parameter(b, "worker1/cpu", "b")
        np.testing.assert_array_equal(wr.to_here(), w)
        lr = 0.1
        opt = remote.DistributedOptimizer([wr, br], "sgd", lr=lr)
        ids = set()
        for fused in (False, True):
            with remote.context() as ctx:
                ids.add(ctx.id)
                y = remote.to(x, "worker1/cpu").linear(wr, br)
                loss = (y * y).mean()
                if fused:
                    opt.backward_and_step(ctx, loss)
                else:
                    ctx.backward(loss)
                    opt.step(ctx)
                # The same step in NumPy: loss = mean(y²), dL/dy = 2y / y.size. The gradients
                # stay on worker1 and are read back from there.
                yl = x @ w.T + b
                dy = 2 * yl / yl.size
                np.testing.assert_allclose(ctx.gradient(wr), dy.T @ x, rtol=1e-12, atol=1e-14)
                np.testing.assert_allclose(ctx.gradient(br), dy.sum(0), rtol=1e-12, atol=1e-14)
                try:
                    ctx.gradient(y)
                except ValueError as e:
                    assert "only a parameter" in str(e), e
                else:
                    raise AssertionError("a gradient of a tensor that is no parameter was read")
            with remote.context() as other:
                assert other.gradient(wr) is None, "a context that ran no backward"
            w, b = w - lr * dy.T @ x, b - lr * dy.sum(0)
            np.testing.assert_allclose(wr.to_here(), w, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(br.to_here(), b, rtol=1e-12, atol=1e-14)
        assert len(ids) == 2, ids
        # Mistakes: a plain remote tensor is no parameter; a backward needs a context.
        try:
            remote.DistributedOptimizer([remote.to(x, "worker1/cpu")])
        except ValueError as e:
            assert "not a remote parameter" in str(e), e
        else:
            raise AssertionError("an optimizer over a plain tensor was accepted")
        try:
            remote.parameter(np.ones(2, dtype=np.int64), "worker1/cpu", "i")
        except ValueError as e:
            assert "float" in str(e), e
        else:
            raise AssertionError("an integer parameter was accepted")
        # A context never entered, and one already left, say so.
        for what, ctx in (("never entered", remote.context()), ("already left", ctx)):
            try:
                ctx.backward(wr.sum())
            except RuntimeError as e:
                assert what in str(e), e
            else:
                raise AssertionError(f"a backward in a context {what} ran")
        try:
            opt.step(ctx)
        except RuntimeError as e:
            assert "already left" in str(e), e
        else:
            raise AssertionError("a step in a context already left ran")
    rpc.shutdown()

def priorities(rank, world):
    """Call priorities from Python: every call form carries the level given by the keyword or
    the ``priority()`` block; functions run by a callee (and the calls they make) inherit it;
    an out-of-range level is a ValueError."""
    _init(rank)
    if rank == 0:
        assert rpc.current_priority() == rpc.PRIORITY_NORMAL
        assert rpc.rpc_sync("worker1", rpcfns.my_priority) == 0
        assert rpc.rpc_sync("worker1", rpcfns.my_priority, priority=rpc.PRIORITY_HIGH) == 4
        assert rpc.rpc_async("worker1", rpcfns.my_priority, priority=-8).wait() == -8
        assert rpc.remote("worker1", rpcfns.my_priority, priority=7).to_here() == 7
        with rpc.priority(rpc.PRIORITY_LOW):
            assert rpc.current_priority() == -4
            assert rpc.rpc_sync("worker1", rpcfns.my_priority) == -4
            # The keyword wins inside a block, and the block comes back after it.
            assert rpc.rpc_sync("worker1", rpcfns.my_priority, priority=5) == 5
            assert rpc.rpc_sync("worker1", rpcfns.nested_priority, ("worker0",)) == -4
            assert rpc.remote("worker1", rpcfns.my_priority).to_here() == -4
        assert rpc.current_priority() == 0
        for bad in (8, -9, 1000):
            try:
                with rpc.priority(bad):
                    pass
                raise AssertionError(f"priority {bad} was accepted")
            except ValueError as e:
                assert "out of range" in str(e)
            try:
                rpc.rpc_sync("worker1", rpcfns.my_priority, priority=bad)
                raise AssertionError(f"priority {bad} was accepted")
            except ValueError:
                pass
        assert rpc.current_priority() == 0
    rpc.shutdown()


def references(rank, world):
    """Functions travel by reference (module and qualified name, resolved once by the callee)
    where their module names them, and pickled otherwise; a reference that names nothing is a
    clear error from the callee, which goes on serving."""
    _init(rank)
    if rank == 0:
        # By reference: module functions, through a class, builtins.
        assert rpc._ref(rpcfns.add) == "rpcfns:add"
        assert pickle.loads(rpc._request("worker1", rpcfns.add, (1, 2), None, -1.0)[3]) == ("rpcfns:add", (1, 2), {})
        assert rpc._ref(rpcfns.Holder.double) == "rpcfns:Holder.double"
        assert rpc._ref(operator.add) == "_operator:add"
        assert rpc.rpc_sync("worker1", rpcfns.add, (2, 3)) == 5
        assert rpc.rpc_sync("worker1", rpcfns.Holder.double, (21,)) == 42
        assert rpc.rpc_sync("worker1", operator.add, ("a", "b")) == "ab"
        assert rpc.rpc_sync("worker1", math.sqrt, (16.0,)) == 4.0
        assert rpc.rpc_async("worker1", rpcfns.add, (1, 1)).wait() == 2
        assert rpc.remote("worker1", rpcfns.add, (4, 4)).to_here() == 8
        # Without arguments the call is the reference alone (no pickle): the callee resolves it
        # once and calls it straight, sync, async, remote, async_execution, raising, and again.
        assert rpc._request("worker1", rpcfns.whoami, None, None, -1.0)[3] == b"rpcfns:whoami"
        for _ in range(2):
            # None, the result of every call made for its effect, is a constant both ways.
            assert rpc.rpc_sync("worker1", rpcfns.noop) is None
            assert rpc.rpc_async("worker1", rpcfns.noop).wait() is None
            assert rpc.remote("worker1", rpcfns.noop).to_here() is None
            assert rpc.rpc_sync("worker1", rpcfns.echo, (None,)) == ((None,), {})
            assert rpc.rpc_sync("worker1", rpcfns.whoami) == "worker1"
            assert rpc.rpc_async("worker1", rpcfns.whoami).wait() == "worker1"
            assert rpc.remote("worker1", rpcfns.whoami).to_here() == "worker1"
            try:
                rpc.rpc_async("worker1", rpcfns.fails_later).wait()
                raise AssertionError("no exception")
            except RuntimeError as e:
                assert "failed asynchronously" in str(e), e
            try:
                rpc.rpc_sync("worker1", rpcfns.key_error)
                raise AssertionError("no exception")
            except KeyError as e:
                assert "missing" in str(e), e
        # Pickled: bound methods, callable objects, partials.
        c = rpcfns.Offset(5)
        for f in (c.get, c, functools.partial(rpcfns.add, 10)):
            assert rpc._ref(f) is f
        assert rpc.rpc_sync("worker1", c.get, (), {"k": 2}) == 7
        assert rpc.rpc_sync("worker1", c, (3,)) == 15
        assert rpc.rpc_sync("worker1", functools.partial(rpcfns.add, 10), (1,)) == 11
        # Arguments that need the lifting pickler still take it.
        t = torch.arange(4)
        assert torch.equal(rpc.rpc_sync("worker1", rpcfns.scale, (t, 3)), t * 3)
        # A reference that names nothing: the callee says so, and serves the next call.
        agent = rpc._require_agent()
        refs = ("no_such_module_xyz:f", "rpcfns:no_such_function", "rpcfns", "rpcfns:Offset.n")
        calls = [pickle.dumps((ref, (), {})) for ref in refs] + [ref.encode() for ref in refs] + [b"\xff\xfe:f"]
        for data in calls:
            for handler in ("py.call", "py.call_async"):
                try:
                    agent.call_sync(("worker1", handler, "k", data, [], [], None))
                    raise AssertionError(f"{data!r} was resolved")
                except RuntimeError as e:
                    assert "cannot load the call" in str(e), e
        # An alias resolves but is not kept: one cache entry per function, whatever peers send.
        for _ in range(2):
            assert agent.call_sync(("worker1", "py.call", "k", b"rpcfns:alias_of_whoami", (), (), None)) == "worker1"
        kept = rpc.rpc_sync("worker1", rpcfns.resolved_refs)
        assert "rpcfns:whoami" in kept and "rpcfns:alias_of_whoami" not in kept, kept
        # Tensors and RRefs come in a list or a tuple, nothing else.
        try:
            agent.call_sync(("worker1", "py.call", "k", b"rpcfns:noop", "ab", (), None))
            raise AssertionError("a str taken for a list of tensors")
        except TypeError as e:
            assert "list or a tuple" in str(e), e
        assert rpc.rpc_sync("worker1", rpcfns.add, (2, 2)) == 4
    rpc.shutdown()
