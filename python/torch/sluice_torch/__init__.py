"""Sluice under ``torch.distributed``: an RPC backend and a process group.

Importing this package registers the RPC backend ``SLUICE`` and the process-group backend
``"sluice"``; the rest of a program is unchanged::

    import sluice_torch
    rpc.init_rpc("worker0", rank=0, world_size=2, backend=sluice_torch.BACKEND)
    # or backend=rpc.BackendType.SLUICE, or rpc.backend_registry.BackendType["SLUICE"]

    dist.init_process_group("sluice", rank=rank, world_size=world)   # DDP, FSDP, collectives
    # or "cpu:sluice,cuda:nccl" beside NCCL

The process group carries dense, contiguous CPU tensors: every collective, ``send``/``recv``
with tags, ``barrier`` and ``monitored_barrier``. Ranks reach each other at ``SLUICE_HOST``, else
at the address that routes to ``MASTER_ADDR``, else on loopback.

Options: ``sluice_torch.SluiceRpcBackendOptions`` (``rpc_timeout``, ``init_method``,
``num_worker_threads``, ``device_maps`` and ``devices`` (with ``set_device_map`` and
``set_devices``, as TensorPipe's), plus Sluice's ``transports``, ``channels`` and ``host``).
CUDA tensors travel where the device maps say, over Sluice's CUDA channels; a program without
maps never touches CUDA.

Dynamic groups (``init_rpc`` without ``world_size``: workers join and leave one at a time, as
with TensorPipe) carry CPU tensors. PyTorch's ``rpc.shutdown`` runs the leave protocol only for
its own TensorPipe agent, so importing this package wraps ``rpc.shutdown`` to run it for a
dynamic SLUICE agent too (every other agent goes to PyTorch's own function unchanged).
"""

import contextlib
import functools
import os
import socket
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed import rpc
from torch.distributed.rpc import api, backend_registry, constants
from torch.distributed.rpc._utils import _update_group_membership

from . import _build

if torch.__version__ != _build.TORCH_VERSION:
    raise ImportError(
        f"sluice_torch was built against torch {_build.TORCH_VERSION} and this is torch "
        f"{torch.__version__}: rebuild it (pip install --no-build-isolation ./python/torch)"
    )

from . import _C  # noqa: E402  (after the version check: a mismatched build may not load)

__all__ = ["BACKEND", "PROCESS_GROUP", "SluiceRpcBackendOptions"]


class SluiceRpcBackendOptions(rpc.RpcBackendOptions):
    """Options of the SLUICE backend, shaped like ``TensorPipeRpcBackendOptions``.

    ``transports`` and ``channels`` are Sluice's names in priority order (``["shm", "tcp"]``,
    ``["cma", "multilane", "basic"]``); ``None`` offers everything viable on this host. ``host``
    is the address this worker listens on (peers connect to it: routable for multi-host groups).
    ``segment_bytes`` (default 0): with 0, tensors between workers of one host go by
    cross-memory attach straight from the sender's tensor into the receiver's own memory (one
    copy, kept memory reused, no page faults in steady state). A size gives this worker a shared
    segment of that many bytes that peers copy tensors into instead (a copy on each side).
    """

    def __init__(
        self,
        *,
        num_worker_threads=constants.DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout=constants.DEFAULT_RPC_TIMEOUT_SEC,
        init_method=constants.DEFAULT_INIT_METHOD,
        transports=None,
        channels=None,
        host="127.0.0.1",
        device_maps=None,
        devices=None,
        segment_bytes=0,
    ):
        super().__init__(rpc_timeout, init_method)
        if num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {num_worker_threads}")
        self.num_worker_threads = num_worker_threads
        self.transports = list(transports) if transports else None
        self.channels = list(channels) if channels else None
        self.host = host
        if not isinstance(segment_bytes, int) or segment_bytes < 0:
            raise ValueError(f"segment_bytes must be a byte count (0 or more), got {segment_bytes!r}")
        self.segment_bytes = segment_bytes
        self.device_maps = {}
        for to, device_map in (device_maps or {}).items():
            self.set_device_map(to, device_map)
        self.devices = []
        if devices:
            self.set_devices(devices)

    def set_device_map(self, to, device_map):
        """Where this worker's CUDA tensors go on worker ``to`` (``{local: remote}``, devices or
        GPU indices), as ``TensorPipeRpcBackendOptions.set_device_map``: one-to-one, CUDA to
        CUDA; responses come back through the reverse map."""
        updated = dict(self.device_maps.get(to, {}))
        for k, v in device_map.items():
            k, v = _cuda(k, "set_device_map"), _cuda(v, "set_device_map")
            if k in updated and updated[k] != v:
                raise ValueError(
                    f"`set_device_map` only supports 1-to-1 mapping, trying to map {k} to {v} and {updated[k]}"
                )
            updated[k] = v
        targets = list(updated.values())
        if len(set(targets)) != len(targets):
            raise ValueError(f"`set_device_map` only supports 1-to-1 mapping, got {updated} for {to}")
        self.device_maps[to] = updated

    def set_devices(self, devices):
        """The GPUs this worker sends from and receives on (by default, every one a map names)."""
        self.devices = [_cuda(d, "set_devices") for d in devices]


def _cuda(device, what):
    """``device`` (an index, a string or a ``torch.device``) as a CUDA device with an index."""
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda" or d.index is None:
        raise ValueError(f"`{what}` expects CUDA devices with an index (cuda:N, or N); got {device!r}")
    return d


def _construct_options(rpc_timeout, init_method, num_worker_threads=constants.DEFAULT_NUM_WORKER_THREADS, **kwargs):
    return SluiceRpcBackendOptions(
        rpc_timeout=rpc_timeout, init_method=init_method, num_worker_threads=num_worker_threads, **kwargs
    )


def _barrier(store, world_size, timeout):
    """Returns once every worker has reached it (a count in the store)."""
    store.add("sluice/init_barrier", 1)
    deadline = time.monotonic() + (timeout if timeout and timeout > 0 else 3600)
    while store.add("sluice/init_barrier", 0) < world_size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"sluice: not every worker reached init's barrier within {timeout} s")
        time.sleep(0.005)


def _new_agent(store, name, rank, world_size, opts):
    return _C.SluiceAgent(
        store,
        name,
        rank,
        world_size,
        opts.rpc_timeout,
        opts.num_worker_threads,
        ",".join(opts.transports or []),
        ",".join(opts.channels or []),
        opts.host,
        f"segment_bytes={opts.segment_bytes}",
        {to: {str(k): str(v) for k, v in m.items()} for to, m in opts.device_maps.items()},
        [str(d) for d in opts.devices],
    )


def _init_backend(store, name, rank, world_size, rpc_backend_options):
    opts = rpc_backend_options
    if not isinstance(opts, SluiceRpcBackendOptions):
        raise TypeError(f"rpc_backend_options must be a SluiceRpcBackendOptions, got {type(opts).__name__}")
    if not world_size:
        return _join_dynamic(store, name, rank, opts)
    agent = _new_agent(store, name, rank, world_size, opts)
    api._init_rpc_states(agent)
    # One round of calls through every pipe, then a barrier so that no worker leaves before the
    # gather's leader is done (as TensorPipe's backend does).
    api._all_gather(None, timeout=opts.rpc_timeout)
    _barrier(store, world_size, opts.rpc_timeout)
    return agent


@contextlib.contextmanager
def _membership_token(store, name, is_join):
    """Holds a dynamic group's membership token while joining or leaving: PyTorch's protocol (the
    same store key and token values as ``torch.distributed.rpc._utils``), except that the token is
    released however the body ends, so a worker whose join failed does not hold up the next one."""
    key = "RpcGroupManagementToken"
    mine = f"Token_for_{name}_{'join' if is_join else 'leave'}"
    while True:
        holder = store.compare_set(key, "", mine).decode()
        if holder == mine:
            break
        store.wait([holder])  # its holder sets it when done (or the store's timeout raises)
    # Set when this name last held this kind of token: cleared, so that waiters wait.
    store.delete_key(mine)
    try:
        yield
    finally:
        store.set(key, "")
        store.set(mine, "Done")


def _join_dynamic(store, name, rank, opts):
    """Joins a dynamic group (PyTorch's protocol, as its TensorPipe backend runs it): holding the
    group's membership token, the agent lists the members in the store and adds itself, starts,
    and tells every member, which connects to it. Returns once every member knows it."""
    if opts.device_maps or opts.devices:
        raise ValueError(
            "the SLUICE backend carries CPU tensors only in a dynamic group (init_rpc without "
            "world_size): device_maps and devices need a static group"
        )
    with _membership_token(store, name, True):
        # A constructor that fails takes this worker off the store's list itself.
        agent = _new_agent(store, name, rank, 0, opts)
        asked = []
        try:
            api._init_rpc_states(agent)
            me = agent.get_worker_info()
            for worker in agent.get_worker_infos():
                if worker.name != name:
                    asked.append(worker.name)
                    try:
                        api.rpc_sync(worker.name, _update_group_membership, args=(me, [], {}, True))
                    except Exception as e:
                        if _still_member(agent, worker.name):
                            raise
                        # Its pipe failed meanwhile and the agent dropped it.
                        warnings.warn(f"sluice: {worker.name} was dropped from the group while {name} joined: {e}")
        except BaseException:
            # Leave as cleanly as we can (this worker holds the token already): every member
            # asked, the one whose answer failed included, is told; then init_rpc fails with
            # the first error.
            try:
                _leave(agent, asked)
            except Exception:
                pass
            finally:
                if api._is_current_rpc_agent_set():
                    api._finalize_shutdown()
            raise
    return agent


def _leave(agent, members):
    """Tells every one of `members` that this worker leaves (each in turn, whatever the others
    answer), waits for its own calls and the requests it serves, and takes it off the store's
    list (the caller holds the membership token). Raises the first failure after all that."""
    me = agent.get_worker_info()
    failed = None
    for worker in members:
        try:
            api.rpc_sync(worker, _update_group_membership, args=(me, [], {}, False))
        except Exception as e:  # the others are still told
            if _still_member(agent, worker):
                failed = failed or e
            else:  # its pipe failed meanwhile and the agent dropped it: nobody there to tell
                warnings.warn(f"sluice: {worker} was dropped from the group while {me.name} left: {e}")
    agent.join(shutdown=True)
    if failed is not None:
        raise failed


def _still_member(agent, name):
    """Whether `name` is still in the agent's group (a member whose pipe failed is dropped)."""
    return any(w.name == name for w in agent.get_worker_infos())


_torch_shutdown = api.shutdown


@functools.wraps(_torch_shutdown)
def shutdown(graceful=True, timeout=constants.DEFAULT_SHUTDOWN_TIMEOUT):
    """``rpc.shutdown``, which also runs a dynamic group's leave protocol for a SLUICE agent
    (PyTorch's own runs it only for TensorPipe's agent); anything else goes to PyTorch's."""
    agent = api._get_current_rpc_agent() if api._is_current_rpc_agent_set() else None
    if graceful and isinstance(agent, _C.SluiceAgent) and not agent.is_static_group:
        try:
            name = agent.get_worker_info().name
            with _membership_token(agent.store, name, False):
                _leave(agent, [w.name for w in agent.get_worker_infos() if w.name != name])
        finally:
            api._finalize_shutdown()  # whatever failed above, this worker's RPC stops
        return
    return _torch_shutdown(graceful, timeout)


def _register():
    if backend_registry.backend_registered("SLUICE"):
        return backend_registry.BackendType["SLUICE"]
    member = backend_registry.register_backend("SLUICE", _construct_options, _init_backend)
    # register_backend makes a new enum: rebind the public name too, so that
    # rpc.BackendType.SLUICE and rpc.BackendType.TENSORPIPE (a member of the new enum) both work.
    rpc.BackendType = backend_registry.BackendType
    return member


BACKEND = _register()
api.shutdown = rpc.shutdown = shutdown


# --- the process group -------------------------------------------------------------------------

PROCESS_GROUP = "sluice"


def _routable_host():
    """The address the other ranks reach this one at (no packet is sent to find it)."""
    if os.environ.get("SLUICE_HOST"):
        return os.environ["SLUICE_HOST"]
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return s.getsockname()[0]
        except OSError:
            pass
    return "127.0.0.1"


def _new_process_group(opts, _backend_options=None):
    return _C.new_process_group(
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
        f"torch:{opts.group_id}",
        _routable_host(),
    )


if PROCESS_GROUP.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(PROCESS_GROUP, _new_process_group, extended_api=True, devices=["cpu"])
