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


# --- tensors that share a storage ------------------------------------------------------------


def aliasing(*ts):
    """Which of `ts` share a storage (each one's first in the list), and what writing 42 into
    the first element of the first shows in each."""
    ptrs = [t.untyped_storage().data_ptr() for t in ts]
    ts[0].view(-1)[0] = 42
    return [ptrs.index(p) for p in ptrs], [t.reshape(-1)[0].item() for t in ts]


def views_of(n):
    a = torch.arange(float(n))
    return a, a.view(-1, 2), a[2:4], a.view(torch.int32)[1:]


def dtypes_heads_and_sharing(*ts):
    ptrs = [t.untyped_storage().data_ptr() for t in ts]
    return [(str(t.dtype), t.reshape(-1)[:3].tolist()) for t in ts], [ptrs.index(p) for p in ptrs]


def grad_sum(x, y):
    return (x * 2).sum() + (y * 3).sum()


def _shared_storages(rank, world, method, backend, out):
    import json

    import torch.distributed.autograd as dist_autograd

    if backend == "SLUICE":
        init(rank, world, method)
    else:
        opts = rpc.TensorPipeRpcBackendOptions(init_method=method)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        got = {}
        # 100 elements: a storage under 8 KiB, sent whole; 100,000: a view using under half of
        # its storage is sent alone (TensorPipe's rule, which the backend follows).
        for n in [100, 100_000]:
            a = torch.arange(float(n))
            cases = {
                "same": (a, a),
                "whole view": (a, a.view(-1, 2)),
                "half": (a, a[: n // 2]),
                "small slice": (a, a[10:20]),
                "two slices": (a[:10], a[-10:]),
                "disjoint halves": (a[: n // 2], a[n // 2 :]),
                "transposed": (a.view(10, -1), a.view(10, -1).t()),
                "three and one alone": (a, torch.ones(3), a.view(2, -1), a[5:]),
            }
            b = a + 0.5
            cases["two storages interleaved"] = (a, b, a[1:], b[1:])
            for name, args in cases.items():
                got[f"{n} {name}"] = rpc.rpc_sync("worker1", aliasing, args=args)
                # The sender's tensors are untouched.
                assert a[0].item() == 0.0
            back = rpc.rpc_sync("worker1", views_of, args=(n,))
            ptrs = [t.untyped_storage().data_ptr() for t in back]
            back[0][2] = 7
            got[f"{n} returned"] = [ptrs.index(p) for p in ptrs], back[2][0].item()
        with dist_autograd.context() as ctx:
            w = torch.arange(10.0, requires_grad=True)
            x = w * 1
            loss = rpc.rpc_sync("worker1", grad_sum, args=(x, x[2:5]))
            dist_autograd.backward(ctx, [loss])
            got["gradient"] = dist_autograd.get_gradients(ctx)[w].tolist()
        if backend == "SLUICE":
            # A view of another dtype arrives as the sender's view of the same bytes (TensorPipe's
            # gives it the storage's first dtype, so this one is not compared).
            # Views of several dtypes whose first bytes are not all aligned alike included.
            a = torch.arange(8.0)
            for args in [(a, a.view(torch.int64), a.view(torch.int16)[3:]), (a[2:], a.view(torch.int16)[1:])]:
                sent = dtypes_heads_and_sharing(*args)
                assert sent[1] == [0] * len(args)
                assert rpc.rpc_sync("worker1", dtypes_heads_and_sharing, args=args) == sent
        pathlib.Path(out).write_text(json.dumps(got))
    rpc.shutdown()


def test_tensors_sharing_a_storage_arrive_sharing_one_as_under_tensorpipe(tmp_path):
    import json

    got = {}
    for backend in ["SLUICE", "TENSORPIPE"]:
        run(_shared_storages, 2, backend, str(tmp_path / backend))
        got[backend] = json.loads((tmp_path / backend).read_text())
    sluice, tensorpipe = got["SLUICE"], got["TENSORPIPE"]
    assert sluice == tensorpipe
    # What that is, so the comparison cannot pass by both sharing nothing or everything.
    assert sluice["100 whole view"] == [[0, 0], [42, 42]]
    assert sluice["100 small slice"] == [[0, 0], [42, 10]]
    assert sluice["100000 small slice"] == [[0, 1], [42, 10]]
    assert sluice["100000 three and one alone"] == [[0, 1, 0, 0], [42, 1, 42, 5]]
    assert sluice["100000 two storages interleaved"] == [[0, 1, 0, 1], [42, 0.5, 1, 1.5]]
    assert sluice["100 returned"] == [[0, 0, 0, 0], 7]
    assert sluice["100000 returned"] == [[0, 0, 2, 0], 2]
    assert sluice["gradient"] == [2, 2, 5, 5, 5, 2, 2, 2, 2, 2]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def view_record(tensor, source, offset, shape, strides, dtype=(2, 32, 1), ndim=None):
    """A view record as the backend writes it (little-endian): float32 unless told."""
    import struct

    ndim = len(shape) if ndim is None else ndim
    head = struct.pack("<IIQBBHI", tensor, source, offset, *dtype, ndim)
    return head + struct.pack(f"<{len(shape)}q", *shape) + struct.pack(f"<{len(strides)}q", *strides)


# A message with two tensors, a float32[4] sent alone and a 64-byte storage, whose view records
# (of the message's tensor 1) are wrong, and why the agent refuses each; then messages whose
# flags (third item) or Sluice tensors (fourth: the storage sent as float32, or a second storage)
# do not fit their records.
MALFORMED_VIEWS = [
    (view_record(1, 1, 0, [4], [1])[:30], "a view record cut short"),
    (view_record(2, 1, 0, [4], [1]), "the view of tensor 2 of a message of 2"),
    (view_record(1, 0, 0, [4], [1]), "in tensor 0 (the shared storages are 1 to 1)"),
    (view_record(1, 2, 0, [4], [1]), "in tensor 2 (the shared storages are 1 to 1)"),
    (view_record(1, 1, 16, [13], [1]), "a view of bytes 16 to 68 of a shared storage of 64"),
    (view_record(1, 1, 2, [4], [1]), "offset 2 is not a multiple of its element size"),
    (view_record(1, 1, 0, [4], [-1]), "size 4 with stride -1 in dimension 0"),
    (view_record(1, 1, 0, [0], [1]), "size 0 with stride 1 in dimension 0"),
    (view_record(1, 1, 0, [4], [1], ndim=1000), "a view of 1000 dimensions"),
    (view_record(1, 1, 0, [1 << 62, 4], [1 << 62, 1]), "a shape and strides past any memory"),
    (view_record(1, 1, 0, [4], [1], dtype=(99, 32, 1)), "the view of tensor 1: Unsupported"),
    (b"", "an empty payload of views"),
    (view_record(1, 1, 0, [4], [1]) + view_record(1, 1, 4, [4], [1]), "view records out of order"),
    (view_record(1, 1, 0, [4], [1]) + view_record(0, 1, 4, [4], [1]), "tensor 0: view records out of order"),
    (view_record(1, 1, (1 << 64) - 4, [1], [1]), "a shape and strides past any memory"),
    (view_record(1, 1, 0, [1 << 62, 4], [0, 0]), "a shape and strides past any memory"),
    (view_record(1, 1, 0, [1 << 61], [0], dtype=(5, 128, 1)), "a shape and strides past any memory"),
    (view_record(1, 1, 0, [4], [1]), "a view with flags 2", b"\0\2"),
    (view_record(1, 1, 0, [4], [1], dtype=(0, 32, 1)), "requires_grad on a tensor of Int", b"\0\1"),
    (view_record(2, 1, 0, [4], [1]), "only 2 tensors for the 2 sent alone", b"\0\0\0"),
    (view_record(1, 1, 0, [4], [1]), "not contiguous bytes in CPU memory", b"\0\0", "float storage"),
    (view_record(1, 1, 0, [4], [1]), "a shared storage no view refers to", b"\0\0", "two storages"),
]


def _malformed_views(rank, world, method, lib):
    import struct

    init(rank, world, method)
    if rank == 0:
        addr = rpc.rpc_sync("worker1", my_address)
        c = ctypes.CDLL(lib)
        ctx = ctypes.c_void_p()
        assert c.sluice_context_new(None, None, ctypes.byref(ctx)) == 0
        storage = (ctypes.c_uint8 * 64)()
        shape = (ctypes.c_int64 * 1)(64)
        plain = (ctypes.c_float * 4)()
        plain_shape = (ctypes.c_int64 * 1)(4)
        as_floats = (ctypes.c_int64 * 1)(16)
        for views, _, *rest in MALFORMED_VIEWS:
            flags = rest[0] if rest else b"\0\0"
            tensors = [(plain, plain_shape, DLDataType(2, 32, 1)), (storage, shape, DLDataType(1, 8, 1))]
            if rest[1:] == ["float storage"]:
                tensors[1] = (storage, as_floats, DLDataType(2, 32, 1))
            if rest[1:] == ["two storages"]:
                tensors.append((storage, shape, DLDataType(1, 8, 1)))
            pipe, msg = ctypes.c_void_p(), ctypes.c_void_p()
            assert c.sluice_connect(ctx, addr.encode(), ctypes.byref(pipe)) == 0
            assert c.sluice_message_new(ctypes.byref(msg)) == 0
            head = struct.pack("<IIiiq", 0x52544C53, 3, 0, 0, 1)
            c.sluice_message_set_metadata(msg, head, len(head))
            c.sluice_message_add_payload(msg, b"x", 1)
            c.sluice_message_add_payload(msg, flags, len(flags))  # a flag byte per message tensor
            c.sluice_message_add_payload(msg, views, len(views))
            for data, shp, dtype in tensors:
                dl = DLTensor(ctypes.cast(data, ctypes.c_void_p), DLDevice(1, 0), 1, dtype, shp, None, 0)
                assert c.sluice_message_add_tensor(msg, ctypes.byref(dl), None, None) == 0
            assert c.sluice_pipe_write_sync(pipe, msg) == 0, views
            # The agent closes the pipe that sent it (no reply ever comes on it).
            got = ctypes.c_void_p()
            assert c.sluice_pipe_read(pipe, ctypes.byref(got)) != 0, views
            c.sluice_pipe_free(pipe)
        c.sluice_context_free(ctx)
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)), torch.full((1,), 2.0))
    rpc.shutdown()


def test_malformed_views_of_a_shared_storage_close_the_pipe_and_nothing_else(capfd):
    lib = str(pathlib.Path(sluice_torch.__file__).parent / "libsluice_c.so")
    run(_malformed_views, 2, lib)
    # Each for its own reason, named in the warning that closes its pipe.
    closed = [line for line in capfd.readouterr().err.splitlines() if "closing the pipe" in line and "it sent" in line]
    assert len(closed) == len(MALFORMED_VIEWS), closed
    for line, (_, why, *_) in zip(closed, MALFORMED_VIEWS):
        assert why in line, (why, line)


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
