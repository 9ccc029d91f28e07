"""The pipe level: messages with metadata, payloads and tensors between processes, dtypes,
strides, zero copy both ways, asyncio, and errors."""

import asyncio
import gc
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import sluice

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def sample(dtype, shape=(3, 5)):
    t = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 7
    return t.to(dtype)


def test_every_dtype_round_trips_through_another_process(echo_peer):
    ctx = sluice.Context()
    with ctx.connect(echo_peer) as pipe:
        tensors = [sample(d) for d in DTYPES]
        pipe.write(sluice.Message(b"dtypes", [b"p0", b"p1"], tensors))
        m = pipe.read()
    assert m.metadata == b"dtypes" and m.payloads == [b"p0", b"p1"]
    assert len(m.tensors) == len(tensors)
    for sent, got in zip(tensors, m.tensors, strict=True):
        assert isinstance(got, torch.Tensor)  # the sender's framework, through a NumPy echo
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)


def test_numpy_arrays_arrive_as_numpy_with_strides(echo_peer):
    base = np.arange(48, dtype=np.int32).reshape(6, 8)
    arrays = [
        base,
        base[:, ::2],  # every other column: a strided view, sent as it lies
        base.T,  # transposed
        np.array(3.5),  # 0-d
        np.zeros((0, 4), dtype=np.float32),  # empty
        np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),  # read-only
    ]
    with sluice.Context().connect(echo_peer) as pipe:
        pipe.write(sluice.Message(tensors=arrays))
        m = pipe.read()
    assert len(m.tensors) == len(arrays)
    for sent, got in zip(arrays, m.tensors, strict=True):
        assert isinstance(got, np.ndarray)
        assert got.dtype == sent.dtype and got.shape == sent.shape
        np.testing.assert_array_equal(got, sent)
    assert m.tensors[1].strides == base[:, ::2].strides
    assert m.tensors[2].strides == base.T.strides


def test_descriptor_says_what_is_coming(echo_peer):
    t = torch.ones(2, 3, dtype=torch.float64)
    with sluice.Context().connect(echo_peer) as pipe:
        pipe.write(sluice.Message(b"m", [b"abc"], [t]))
        d = pipe.read_descriptor()
        assert d.metadata == b"m" and d.payload_lengths == [3]
        (info,) = d.tensors
        assert info["dtype"] == "float64" and info["shape"] == [2, 3] and info["nbytes"] == 48
        assert info["framework"] == "torch" and info["device"] == "cpu"
        m = pipe.read(d)
    assert torch.equal(m.tensors[0], t)


def test_received_tensors_view_the_memory_the_pipe_received_into(echo_peer):
    t = torch.randn(1 << 16)
    a = np.arange(1 << 12, dtype=np.float64)
    with sluice.Context().connect(echo_peer) as pipe:
        pipe.write(sluice.Message(tensors=[t, a]))
        m = pipe.read()
    assert len(m.tensors) == len(m.raw_tensors) == 2
    for got, raw in zip(m.tensors, m.raw_tensors, strict=True):
        start, length = raw.buffer
        ptr = got.data_ptr() if isinstance(got, torch.Tensor) else got.__array_interface__["data"][0]
        assert start <= ptr < start + length, "the received tensor is a copy"
        assert ptr == raw.data_ptr
    # Writable, and writing does not disturb anything else.
    m.tensors[0][0] = 42.0
    assert m.tensors[0][0] == 42.0


def test_sending_reads_the_tensors_own_memory():
    t = torch.arange(100, dtype=torch.float32)
    assert sluice._send_view(t) == (t.data_ptr(), 400)
    view = t[10:50:2]
    assert sluice._send_view(view)[0] == view.data_ptr()
    a = np.arange(64, dtype=np.int64).reshape(8, 8)[:, 1::3]
    assert sluice._send_view(a)[0] == a.__array_interface__["data"][0]
    # A tensor that requires grad is sent detached, still without a copy.
    p = torch.nn.Parameter(torch.ones(4))
    from sluice._tensors import sendable

    assert sluice._send_view(sendable(p))[0] == p.data_ptr()


def test_a_torch_tensor_sent_from_a_thread_is_not_copied_by_the_pipe():
    """In-process pipe over shared memory: the write reads the tensor's own memory (no copy
    into a staging buffer of the binding's), the receiver gets those bytes in memory of its
    own, and the sender's tensor is released once the write has completed."""
    ctx = sluice.Context()
    listener = ctx.listen("127.0.0.1:0")
    got = {}

    def serve():
        p = listener.accept()
        got["m"] = p.read()

    th = threading.Thread(target=serve)
    th.start()
    pipe = ctx.connect(listener.address)
    t = torch.arange(1 << 20, dtype=torch.int32)
    want = t.clone()
    assert sluice._send_view(t) == (t.data_ptr(), t.nbytes)
    refs = sys.getrefcount(t)
    pipe.write(sluice.Message(tensors=[t]))
    th.join(60)
    assert not th.is_alive(), "the reader never finished"
    assert len(got["m"].tensors) == 1
    r = got["m"].tensors[0]
    assert torch.equal(r, want) and r.data_ptr() != t.data_ptr()
    # The binding's reference goes when the write completes (its release may run on the
    # library's thread just after write() returns).
    deadline = time.monotonic() + 5
    while sys.getrefcount(t) != refs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sys.getrefcount(t) == refs, "the pipe still holds the sent tensor"
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is None, "the sent tensor was never released"


def test_asyncio_forms(echo_peer):
    async def main():
        pipe = await sluice.Context().connect_async(echo_peer)
        t = torch.linspace(0, 1, 1000)
        await pipe.write_async(sluice.Message(b"a", [], [t]))
        d = await pipe.read_descriptor_async()
        m = await pipe.read_async(d)
        pipe.close()
        return m

    m = asyncio.run(main())
    assert m.metadata == b"a" and torch.equal(m.tensors[0], torch.linspace(0, 1, 1000))


def test_read_into_copies_into_the_callers_tensors(echo_peer):
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dst = torch.zeros(3, 4)
    with sluice.Context().connect(echo_peer) as pipe:
        pipe.write(sluice.Message(tensors=[src]))
        m = pipe.read(into=[dst])
    assert m.tensors[0] is dst and torch.equal(dst, src)


def test_bad_input_is_a_clear_error(echo_peer):
    ctx = sluice.Context()
    with pytest.raises(ValueError, match="unknown transport"):
        sluice.Context(transports=["carrier-pigeon"])
    with pytest.raises(ValueError, match="unknown channel"):
        sluice.Context(channels=["teleport"])
    with ctx.connect(echo_peer) as pipe:
        with pytest.raises(TypeError, match="no __dlpack__"):
            pipe.write(sluice.Message(tensors=[[1, 2, 3]]))
        # The pipe still works after a refused message.
        pipe.write(sluice.Message(b"still"))
        assert pipe.read().metadata == b"still"
    with pytest.raises(sluice.PipeError):
        pipe.write(sluice.Message(b"after close"))
    port = sluice.Context().listen("127.0.0.1:0")
    address = port.address
    port.close()
    with pytest.raises(sluice.PipeError):
        ctx.connect(address)


def test_the_gil_is_released_while_waiting():
    """The main thread blocks in read_descriptor while a Python thread counts and another
    sends late: were the GIL held during the wait, neither could run."""
    ctx = sluice.Context()
    listener = ctx.listen("127.0.0.1:0")
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)

    def send_late():
        p = listener.accept()
        stop.wait(0.3)
        p.write(sluice.Message(b"late"))
        stop.wait(0.2)

    threads = [threading.Thread(target=spin), threading.Thread(target=send_late)]
    for th in threads:
        th.start()
    pipe = ctx.connect(listener.address)
    before = len(ticks)
    d = pipe.read_descriptor()
    during = len(ticks) - before
    stop.set()
    for th in threads:
        th.join()
    assert d.metadata == b"late"
    assert during > 0, "no Python thread ran while the pipe waited"
