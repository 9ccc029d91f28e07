"""Received tensors as the caller's framework type."""

import sys


def from_dlpack(received, framework=None):
    """A received tensor as a torch tensor or NumPy array viewing the received memory.

    ``framework``: "torch", "numpy", or "raw" (the DLPack producer itself, for any other
    framework's ``from_dlpack``); None picks the sender's framework, else torch when this
    process has it imported, else NumPy. A dtype NumPy lacks (bfloat16) arrives as a torch
    tensor when torch is importable, else raw.
    """
    name = framework or received.framework
    if name == "raw":
        return received
    if name == "torch" or (framework is None and name != "numpy" and "torch" in sys.modules):
        return _torch().from_dlpack(received)
    try:
        import numpy
    except ImportError:
        return received
    try:
        return numpy.from_dlpack(received)
    except (RuntimeError, BufferError, TypeError):
        try:
            return _torch().from_dlpack(received)
        except ImportError:
            return received


def _torch():
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    return torch


def is_tensor(obj):
    """True for objects sent through channels instead of pickled: those speaking DLPack."""
    t = type(obj)
    return hasattr(t, "__dlpack__") and not isinstance(obj, type)


def sendable(obj):
    """The object as DLPack can export it (a torch tensor that requires grad is detached)."""
    if getattr(obj, "requires_grad", False):
        return obj.detach()
    return obj
