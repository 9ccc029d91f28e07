"""The pipe level: a negotiated link to one peer that carries messages of metadata, payloads and
tensors (each over the fastest channel the two processes share)."""

from dataclasses import dataclass, field
from typing import Any, List, Optional

from . import _sluice
from ._tensors import from_dlpack, is_tensor, sendable


@dataclass
class Message:
    """What a pipe carries: metadata bytes, payloads (small bytes) and tensors (moved by the
    pipe's channels without a copy; anything with ``__dlpack__``)."""

    metadata: bytes = b""
    payloads: List[bytes] = field(default_factory=list)
    tensors: List[Any] = field(default_factory=list)
    #: On a received message: the DLPack producers over the received memory, one per tensor.
    raw_tensors: List[Any] = field(default_factory=list)


@dataclass
class Descriptor:
    """A message before its data: what it holds, to decide where it goes."""

    metadata: bytes
    payload_lengths: List[int]
    tensors: List[dict]


def _args(message):
    tensors = []
    for t in message.tensors:
        if not is_tensor(t):
            raise TypeError(
                f"a {type(t).__name__} cannot be sent as a tensor: it has no __dlpack__ "
                "(torch.Tensor, numpy.ndarray, CuPy and JAX arrays have one)"
            )
        tensors.append(sendable(t))
    return bytes(message.metadata), [bytes(p) for p in message.payloads], tensors


def _message(raw, framework):
    metadata, payloads, received = raw
    return Message(
        metadata=metadata,
        payloads=payloads,
        tensors=[from_dlpack(r, framework) for r in received],
        raw_tensors=received,
    )


def _descriptor(raw):
    return Descriptor(*raw)


class Pipe:
    """A link to one peer. Every blocking method releases the GIL while it waits; the
    ``*_async`` forms return awaitables for asyncio."""

    def __init__(self, native):
        self._native = native
        self._framework = None

    @property
    def info(self) -> dict:
        """What negotiation chose: peer, transport, CPU channel, lanes."""
        return self._native.info

    def write(self, message: Message) -> None:
        """Sends ``message``; returns once its buffers may be reused."""
        self._native.write(*_args(message))

    async def write_async(self, message: Message) -> None:
        await self._native.write_async(*_args(message))

    def read_descriptor(self) -> Descriptor:
        return _descriptor(self._native.read_descriptor())

    async def read_descriptor_async(self) -> Descriptor:
        return _descriptor(await self._native.read_descriptor_async())

    def read(self, descriptor: Optional[Descriptor] = None, *, framework=None, into=None) -> Message:
        """Receives the message whose descriptor was read (reads it first if none was).

        Tensors arrive as the sender's framework type (``framework`` overrides: "torch",
        "numpy"), viewing the memory the pipe received into. ``into``: a list of tensors to copy
        the received ones into (a copy, for callers who need the data in memory of their own).
        """
        if descriptor is None:
            self.read_descriptor()
        m = _message(self._native.read(), framework)
        return _copy_into(m, into)

    async def read_async(self, descriptor=None, *, framework=None, into=None) -> Message:
        if descriptor is None:
            await self.read_descriptor_async()
        m = _message(await self._native.read_async(), framework)
        return _copy_into(m, into)

    def close(self) -> None:
        self._native.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _copy_into(message, into):
    if into is None:
        return message
    if len(into) != len(message.tensors):
        raise ValueError(f"into= has {len(into)} tensors for a message with {len(message.tensors)}")
    out = []
    for dst, src in zip(into, message.tensors):
        if hasattr(dst, "copy_"):  # torch
            import torch

            dst.copy_(torch.from_dlpack(message.raw_tensors[len(out)]))
        else:  # numpy and friends
            import numpy

            numpy.copyto(dst, numpy.from_dlpack(message.raw_tensors[len(out)]))
        out.append(dst)
    message.tensors = out
    return message


class Listener:
    """Accepts pipes."""

    def __init__(self, native):
        self._native = native

    @property
    def address(self) -> str:
        return self._native.address

    def accept(self) -> Pipe:
        return Pipe(self._native.accept())

    async def accept_async(self) -> Pipe:
        return Pipe(await self._native.accept_async())

    def close(self) -> None:
        self._native.close()


class Context:
    """A process's transports and channels. ``transports`` (``"shm"``, ``"tcp"``, ``"ibv"``) and
    ``channels`` (``"cma"``, ``"multilane"``, ``"basic"``, the CUDA ones, ...) restrict and order
    what negotiation may choose; None offers everything viable here."""

    def __init__(self, transports=None, channels=None, name=None):
        self._native = _sluice._Context(transports, channels, name)

    @property
    def transports(self):
        return self._native.transports

    @property
    def channels(self):
        return self._native.channels

    def listen(self, address: str = "127.0.0.1:0") -> Listener:
        return Listener(self._native.listen(address))

    def connect(self, address: str) -> Pipe:
        return Pipe(self._native.connect(address))

    async def connect_async(self, address: str) -> Pipe:
        return Pipe(await self._native.connect_async(address))


__all__ = ["Context", "Descriptor", "Listener", "Message", "Pipe", "from_dlpack"]
