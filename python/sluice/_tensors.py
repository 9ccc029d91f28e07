"""Received tensors as the caller's framework type."""

import sys


def from_dlpack(received, framework=None):
    """A received tensor as a torch tensor or NumPy array viewing the received memory.

    ``framework``: "torch" or "numpy"; None picks the sender's framework when this process has
    it imported, then torch, then NumPy, else returns the DLPack producer itself.
    """
    name = framework or received.framework
    if name == "torch" or (framework is None and name not in ("numpy",) and "torch" in sys.modules):
        torch = sys.modules.get("torch")
        if torch is None:
            import torch
        return torch.from_dlpack(received)
    if name == "numpy" or framework is None:
        try:
            import numpy
        except ImportError:
            return received
        return numpy.from_dlpack(received)
    return received


def is_tensor(obj):
    """True for objects sent through channels instead of pickled: those speaking DLPack."""
    t = type(obj)
    return hasattr(t, "__dlpack__") and not isinstance(obj, type)


def sendable(obj):
    """The object as DLPack can export it (a torch tensor that requires grad is detached)."""
    if getattr(obj, "requires_grad", False):
        return obj.detach()
    return obj
