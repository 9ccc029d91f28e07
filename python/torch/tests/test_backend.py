"""The SLUICE backend's own behaviour, across real processes: calls and tensors of every kind,
typed errors, timeouts, a peer that dies, a peer that sends garbage, and that importing the
backend leaves PyTorch's own backend usable.

    python -m pytest -q python/torch/tests/test_backend.py
"""

import ctypes
import os
import pathlib
import time

import pytest
import torch
import torch.distributed.rpc as rpc

import sluice_torch
from procs import run

def init(rank, world, method, **kw):
    opts = sluice_torch.SluiceRpcBackendOptions(init_method=method, rpc_timeout=30, **kw)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, backend=rpc.BackendType.SLUICE, rpc_backend_options=opts)


def fail(message):
    raise ValueError(message)


class Typed(Exception):
    pass


def fail_typed():
    raise Typed("typed")


def nap(seconds):
    time.sleep(seconds)
    return seconds


def echo(x):
    return x


def my_address():
    return rpc.api._get_current_rpc_agent().address


def die_soon():
    import threading

    threading.Timer(0.3, lambda: os._exit(3)).start()


def _calls(rank, world, method):
    init(rank, world, method)
    if rank == 0:
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(3), 1)), torch.full((3,), 2.0))
        futs = [rpc.rpc_async("worker1", torch.mul, args=(torch.ones(4), i)) for i in range(64)]
        assert [f.wait()[0].item() for f in futs] == [float(i) for i in range(64)]
        assert torch.equal(rpc.remote("worker1", torch.add, args=(torch.ones(2), 2)).to_here(), torch.full((2,), 3.0))
        # Tensors of every kind come back equal: large, strided views, empty, many dtypes,
        # nested in Python structures.
        big = torch.randn(16 << 20)  # 64 MiB
        assert torch.equal(rpc.rpc_sync("worker1", echo, args=(big,)), big)
        view = torch.arange(100.0).reshape(10, 10)[:, 3]
        assert torch.equal(rpc.rpc_sync("worker1", echo, args=(view,)), view)
        for t in [
            torch.empty(0),
            torch.empty(3, 0, 2),
            torch.tensor([True, False]),
            torch.arange(5, dtype=torch.int8),
            torch.arange(5, dtype=torch.int64),
            torch.randn(4).to(torch.bfloat16),
            torch.randn(4).half(),
            torch.randn(3, dtype=torch.complex64),
            torch.tensor(7.0),
        ]:
            back = rpc.rpc_sync("worker1", echo, args=(t,))
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), t
        nested = {"a": [torch.ones(2), (torch.zeros(3, dtype=torch.int32), "s")], "b": 5}
        back = rpc.rpc_sync("worker1", echo, args=(nested,))
        assert torch.equal(back["a"][1][0], nested["a"][1][0]) and back["b"] == 5
        # Errors keep their type through every call form.
        with pytest.raises(ValueError, match="remote boom"):
            rpc.rpc_sync("worker1", fail, args=("remote boom",))
        with pytest.raises(ValueError, match="async boom"):
            rpc.rpc_async("worker1", fail, args=("async boom",)).wait()
        with pytest.raises(ValueError, match="rref boom"):
            rpc.remote("worker1", fail, args=("rref boom",)).to_here()
        # A user-defined type comes back as PyTorch's Python layer rebuilds it (the same on
        # TensorPipe): named in a RuntimeError.
        with pytest.raises((Typed, RuntimeError), match="Typed"):
            rpc.rpc_sync("worker1", fail_typed)
        with pytest.raises(RuntimeError):
            rpc.rpc_sync("worker9", torch.add, args=(torch.ones(1), 1))
        # A timeout fails the call with PyTorch's timeout text; the late reply is dropped and
        # the pipe goes on.
        with pytest.raises(RuntimeError, match="RPC ran for more than"):
            rpc.rpc_sync("worker1", nap, args=(1.0,), timeout=0.2)
        assert rpc.rpc_sync("worker1", nap, args=(0.0,)) == 0.0
        time.sleep(1.0)
        m = rpc.api._get_current_rpc_agent().get_metrics()
        assert m["agent.pipe.worker1"].startswith(("shm/", "tcp/")), m
        assert int(m["agent.num_pending_requests"]) == 0, m
        assert int(m["agent.messages_sent"]) > 80, m
    rpc.shutdown()


def test_calls_tensors_errors_and_timeouts():
    run(_calls, 2)


def _peer_dies(rank, world, method):
    init(rank, world, method)
    if rank == 0:
        slow = rpc.rpc_async("worker1", nap, args=(20.0,), timeout=0)
        rpc.rpc_sync("worker1", die_soon)
        with pytest.raises(RuntimeError, match="worker1"):
            slow.wait()
        rpc.shutdown(graceful=False)
    else:
        time.sleep(60)


def test_a_peer_that_dies_fails_its_pending_calls_naming_it():
    run(_peer_dies, 2, expect_exit=[0, 3])


def _garbage(rank, world, method, lib):
    init(rank, world, method)
    if rank == 0:
        addr = rpc.rpc_sync("worker1", my_address)
        c = ctypes.CDLL(lib)
        ctx, pipe, msg = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        assert c.sluice_context_new(None, None, ctypes.byref(ctx)) == 0
        assert c.sluice_connect(ctx, addr.encode(), ctypes.byref(pipe)) == 0
        for meta in [b"abc", b"\0" * 24, b"SLTR" + b"\0" * 20]:
            assert c.sluice_message_new(ctypes.byref(msg)) == 0
            c.sluice_message_set_metadata(msg, meta, len(meta))
            c.sluice_pipe_write_sync(pipe, msg)
        # The pipe that sent garbage is closed by the agent; its other pipes go on.
        got = ctypes.c_void_p()
        assert c.sluice_pipe_read(pipe, ctypes.byref(got)) != 0
        c.sluice_pipe_free(pipe)
        c.sluice_context_free(ctx)
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)), torch.full((1,), 2.0))
    rpc.shutdown()


def test_garbage_from_a_peer_closes_its_pipe_and_nothing_else():
    lib = str(pathlib.Path(sluice_torch.__file__).parent / "libsluice_c.so")
    run(_garbage, 2, lib)


def _tensorpipe_after_import(rank, world, method):
    import sluice_torch  # noqa: F401

    opts = rpc.TensorPipeRpcBackendOptions(init_method=method)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, backend=rpc.BackendType.TENSORPIPE, rpc_backend_options=opts)
    assert torch.equal(rpc.rpc_sync(f"worker{(rank + 1) % world}", torch.add, args=(torch.ones(1), 1)), torch.full((1,), 2.0))
    rpc.shutdown()


def test_importing_the_backend_leaves_tensorpipe_usable():
    assert rpc.BackendType.SLUICE is rpc.backend_registry.BackendType["SLUICE"]
    assert isinstance(rpc.BackendType.TENSORPIPE, rpc.backend_registry.BackendType)
    run(_tensorpipe_after_import, 2)


def _maps_without_cuda(rank, world, method):
    import sluice_torch

    opts = sluice_torch.SluiceRpcBackendOptions(init_method=method, device_maps={"worker0": {0: 0}})
    try:
        rpc.init_rpc("worker0", rank=rank, world_size=world, backend=sluice_torch.BACKEND, rpc_backend_options=opts)
    except RuntimeError as e:
        assert "cuda:0" in str(e) and ("no CUDA" in str(e) or "GPU(s)" in str(e)), e
    else:
        raise AssertionError("device maps were accepted where there is no GPU")


def test_device_maps_without_a_gpu_fail_at_init_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU (the check is for machines without one)")
    run(_maps_without_cuda, 1)


def _one_fails_to_start(rank, world, method):
    import sluice_torch

    # worker1 cannot start (it names a GPU this machine lacks, after publishing its empty
    # maps); worker0 hears why instead of waiting for its address.
    devices = [0] if rank == 1 else None
    opts = sluice_torch.SluiceRpcBackendOptions(init_method=method, devices=devices, rpc_timeout=120)
    started = time.monotonic()
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, backend=sluice_torch.BACKEND, rpc_backend_options=opts)
    except RuntimeError as e:
        assert "cuda:0" in str(e), e
        if rank == 0:
            assert "worker1 could not start" in str(e), e
    else:
        raise AssertionError(f"worker{rank} started beside a worker that could not")
    assert time.monotonic() - started < 60, "the failure was heard only after the store's timeout"


def test_a_worker_that_cannot_start_fails_the_others_with_its_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU (the check is for machines without one)")
    run(_one_fails_to_start, 2)


def test_options_are_checked():
    with pytest.raises(ValueError, match="num_worker_threads"):
        sluice_torch.SluiceRpcBackendOptions(num_worker_threads=0)
    # Device maps and devices as TensorPipe's options take them: indices, strings, devices.
    opts = sluice_torch.SluiceRpcBackendOptions(device_maps={"worker1": {0: "cuda:1"}}, devices=[0, "cuda:1"])
    opts.set_device_map("worker1", {torch.device("cuda:2"): 3})
    assert opts.device_maps == {"worker1": {torch.device("cuda:0"): torch.device("cuda:1"), torch.device("cuda:2"): torch.device("cuda:3")}}
    assert opts.devices == [torch.device("cuda:0"), torch.device("cuda:1")]
    with pytest.raises(ValueError, match="1-to-1"):
        opts.set_device_map("worker1", {0: 2})
    with pytest.raises(ValueError, match="1-to-1"):
        opts.set_device_map("worker1", {5: 1})  # cuda:0 goes to cuda:1 already
    assert torch.device("cuda:5") not in opts.device_maps["worker1"], "a refused map changes nothing"
    with pytest.raises(ValueError, match="CUDA devices"):
        opts.set_device_map("worker1", {"cpu": 0})
    with pytest.raises(ValueError, match="CUDA devices"):
        opts.set_devices(["cpu"])
    opts = rpc.backend_registry.construct_rpc_backend_options(sluice_torch.BACKEND, rpc_timeout=5, num_worker_threads=3)
    assert isinstance(opts, sluice_torch.SluiceRpcBackendOptions)
    assert opts.rpc_timeout == 5 and opts.num_worker_threads == 3
    opts.set_device_map("worker1", {0: 0})
    with pytest.raises(ValueError, match="CPU tensors only in a dynamic group"):
        sluice_torch._init_backend(None, "w", 0, None, opts)


# --- dynamic groups ----------------------------------------------------------------------------


def whoami():
    return rpc.get_worker_info().name


def members():
    return sorted(w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos())


def _join_dynamic(rank, method, name=None):
    opts = sluice_torch.SluiceRpcBackendOptions(init_method=method, rpc_timeout=30)
    rpc.init_rpc(name or f"worker{rank}", rank=rank, backend=sluice_torch.BACKEND, rpc_backend_options=opts)


def _elastic(rank, world, method):
    """worker0 starts alone; worker1 and worker2 join; worker1 leaves while the others go on
    calling each other; a call to worker1 then fails naming it; a new process joins as worker1
    (PyTorch's own protocol needs a fresh process to join again)."""
    import torch.distributed as dist

    # A side channel that orders the steps (not the group's own store).
    store = dist.FileStore(method[len("file://") :] + ".steps", world)
    step = lambda name: store.set(name, "1")  # noqa: E731
    after = lambda name: store.wait([name])  # noqa: E731
    if rank == 0:
        _join_dynamic(0, method)
        assert members() == ["worker0"]
        step("0 up")
        after("1 up")
        after("2 up")
        assert members() == ["worker0", "worker1", "worker2"]
        assert rpc.rpc_sync("worker2", whoami) == "worker2"
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))
        step("0 called")
        after("1 left")
        assert members() == ["worker0", "worker2"]
        with pytest.raises(RuntimeError, match="worker1"):
            rpc.rpc_sync("worker1", whoami)
        assert rpc.rpc_sync("worker2", members) == ["worker0", "worker2"]
        step("0 saw 1 leave")
        after("1 back")
        assert rpc.rpc_sync("worker1", whoami) == "worker1"
        assert members() == ["worker0", "worker1", "worker2"]
        m = rpc.api._get_current_rpc_agent().get_metrics()
        assert m["agent.pipe.worker1"].startswith(("shm/", "tcp/")), m
    elif rank == 1:
        after("0 up")
        _join_dynamic(1, method)
        step("1 up")
        after("2 up")
        assert rpc.rpc_sync("worker2", whoami) == "worker2"
        after("0 called")
        rpc.shutdown()
        step("1 left")
        return
    elif rank == 2:
        after("1 up")
        _join_dynamic(2, method)
        assert members() == ["worker0", "worker1", "worker2"]
        step("2 up")
        after("1 left")
        assert rpc.rpc_sync("worker0", members) == ["worker0", "worker2"]
    else:
        after("0 saw 1 leave")
        _join_dynamic(1, method, name="worker1")
        assert members() == ["worker0", "worker1", "worker2"]
        assert rpc.rpc_sync("worker2", whoami) == "worker2"
        step("1 back")
    step(f"{rank} done")
    for r in (0, 2, 3):
        after(f"{r} done")
    rpc.shutdown()


def test_a_dynamic_group_lets_workers_join_leave_and_join_again():
    run(_elastic, 4)


def _failed_join(rank, world, method):
    """A worker whose join fails (it cannot listen where it is told to) takes itself off the
    group's list and releases the membership token: the next worker joins as if it never came."""
    import torch.distributed as dist

    store = dist.FileStore(method[len("file://") :] + ".steps", world)
    if rank == 0:
        _join_dynamic(0, method)
        store.set("0 up", "1")
        store.wait(["2 up"])
        assert members() == ["worker0", "worker2"], members()
        store.set("0 checked", "1")
    elif rank == 1:
        store.wait(["0 up"])
        # 192.0.2.1 (TEST-NET-1) is no address of this host: listening there fails at once.
        opts = sluice_torch.SluiceRpcBackendOptions(init_method=method, rpc_timeout=30, host="192.0.2.1")
        with pytest.raises(RuntimeError, match="cannot listen"):
            rpc.init_rpc("worker1", rank=1, backend=sluice_torch.BACKEND, rpc_backend_options=opts)
        store.set("1 failed", "1")
        return
    else:
        store.wait(["1 failed"])
        _join_dynamic(2, method)
        assert members() == ["worker0", "worker2"]
        assert rpc.rpc_sync("worker0", whoami) == "worker0"
        store.set("2 up", "1")
        store.wait(["0 checked"])
    rpc.shutdown()


def test_a_failed_join_leaves_the_dynamic_group_as_it_was():
    run(_failed_join, 3)


def _member_dies(rank, world, method):
    """worker1 dies without leaving. The survivors drop it once its pipe fails (a call to it then
    fails naming it), a new worker joins past its stale entry in the store's list (dropping it
    there), and everyone still in the group leaves cleanly."""
    import torch.distributed as dist

    store = dist.FileStore(method[len("file://") :] + ".steps", world)
    if rank == 1:
        store.wait(["0 up"])
        _join_dynamic(1, method)
        store.set("1 up", "1")
        store.wait(["2 up"])
        os._exit(7)  # no shutdown: still on the store's list
    if rank == 0:
        _join_dynamic(0, method)
        store.set("0 up", "1")
    elif rank == 2:
        store.wait(["1 up"])
        _join_dynamic(2, method)
        store.set("2 up", "1")
    else:
        store.wait(["1 gone"])
        _join_dynamic(3, method)
        assert members() == ["worker0", "worker2", "worker3"], members()
        store.set("3 up", "1")
    if rank in (0, 2):
        store.wait(["2 up"])  # worker1 has joined (and is dying)
        # The survivors see worker1 go when its pipe fails (its process is gone).
        deadline = time.monotonic() + 30
        while "worker1" in members():
            assert time.monotonic() < deadline, "worker1 is still a member 30 s after it died"
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="worker1"):
            rpc.rpc_sync("worker1", whoami)
        store.set(f"{rank} saw 1 gone", "1")
        if rank == 0:
            store.wait(["2 saw 1 gone"])
            store.set("1 gone", "1")
        store.wait(["3 up"])
        assert members() == ["worker0", "worker2", "worker3"], members()
        assert rpc.rpc_sync("worker3", whoami) == "worker3"
    store.set(f"{rank} done", "1")
    store.wait(["0 done", "2 done", "3 done"])
    rpc.shutdown()


def test_a_dynamic_member_that_dies_is_dropped_and_the_group_goes_on():
    run(_member_dies, 4, expect_exit=[0, 7, 0, 0])
