"""Sluice from Python.

Two levels:

* the pipe (``sluice.Context``, ``listen``, ``connect``, ``Pipe.write`` / ``read_descriptor`` /
  ``read``, blocking and ``*_async`` for asyncio), for frameworks that build their own protocol;
* RPC (``sluice.rpc``), shaped like ``torch.distributed.rpc``: ``init_rpc``, ``rpc_sync``,
  ``rpc_async``, ``remote``, ``RRef``, ``shutdown``;
* remote tensors (``sluice.remote``): ``RemoteTensor.place(array, "worker1/cpu")``, operations
  recorded and run on the owner as one call.

Tensors (anything with ``__dlpack__``: torch, NumPy, CuPy, JAX) are sent without a copy and
arrive without one, as the sender's framework type when this process has it.
"""

from ._sluice import PipeError, Received, RpcError, RpcTimeout, _send_view
from .pipe import Context, Descriptor, Listener, Message, Pipe, from_dlpack
from . import rpc

__all__ = [
    "Context",
    "Descriptor",
    "Listener",
    "Message",
    "Pipe",
    "PipeError",
    "Received",
    "RpcError",
    "RpcTimeout",
    "from_dlpack",
    "remote",
    "rpc",
]


def __getattr__(name):
    # sluice.remote needs NumPy, which plain pipes and RPC do not: imported on first use.
    if name == "remote":
        import importlib

        return importlib.import_module(".remote", __name__)
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")
