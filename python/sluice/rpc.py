"""RPC shaped like ``torch.distributed.rpc``, on Sluice's agent.

Functions are named by reference, as PyTorch does: a call pickles ``(func, args, kwargs)`` and
the callee imports ``func`` by module and qualified name (a call without arguments sends the
reference alone). Every tensor inside the arguments or the result (anything with
``__dlpack__``) is lifted out of the pickle and moved by the pipe's channels without a copy;
it arrives as the sender's framework type. Errors the callee raises
arrive as the same exception type, with its message and the remote traceback.

Every wait releases the GIL; handlers run on the agent's pool with it, so a handler that blocks
or raises never stalls the agent.
"""

import asyncio
import atexit
import contextlib
import functools
import importlib
import io
import os
import pickle
import threading
import traceback
import types
from typing import Any, Dict, NamedTuple, Optional

from . import _sluice
from ._sluice import RpcError, RpcTimeout
from ._tensors import from_dlpack, is_tensor, sendable

_agent = None
_TRACEBACK = "\n--- remote traceback ---\n"


class WorkerInfo(NamedTuple):
    name: str
    id: int


class RpcBackendOptions:
    """Options of ``init_rpc`` (``TensorPipeRpcBackendOptions`` is an alias, so code written
    for PyTorch keeps working).

    ``init_method``: ``"env://"`` (MASTER_ADDR, MASTER_PORT, as torchrun sets them) or
    ``"tcp://host:port"``. ``rpc_timeout``: the default timeout in seconds (0: none).
    ``device_maps``: ``{"worker1": {"cuda:0": "cuda:1"}}``. ``transports`` / ``channels``:
    restrict and order what pipes may use. ``listen``: the address pipes are accepted on.
    """

    def __init__(
        self,
        *,
        init_method: str = "env://",
        rpc_timeout: float = 60.0,
        device_maps: Optional[Dict[str, Dict[Any, Any]]] = None,
        num_worker_threads: Optional[int] = None,
        transports=None,
        channels=None,
        listen: Optional[str] = None,
        _transports=None,
        _channels=None,
    ):
        self.init_method = init_method
        self.rpc_timeout = rpc_timeout
        self.device_maps = {k: dict(v) for k, v in (device_maps or {}).items()}
        self.num_worker_threads = num_worker_threads
        self.transports = transports or _transports
        self.channels = channels or _channels
        self.listen = listen

    def set_device_map(self, to: str, device_map: Dict[Any, Any]) -> None:
        self.device_maps.setdefault(to, {}).update(device_map)


TensorPipeRpcBackendOptions = RpcBackendOptions


def _require_agent():
    if _agent is None:
        raise RpcError("RPC has not been initialized: call sluice.rpc.init_rpc first")
    return _agent


def _device(d) -> str:
    s = str(d)
    if s.isdigit():
        return f"cuda:{s}"
    return s


def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None, *, options=None):
    """Joins the group as ``name``. ``rank`` and ``world_size`` default to the launcher's
    variables (RANK, WORLD_SIZE), the rendezvous to MASTER_ADDR and MASTER_PORT."""
    global _agent
    if _agent is not None:
        raise RpcError("RPC is already initialized in this process")
    opts = options or rpc_backend_options or RpcBackendOptions()
    store = None
    if opts.init_method and opts.init_method.startswith("tcp://"):
        store = opts.init_method[len("tcp://"):]
    if rank is None or rank < 0:
        rank = int(os.environ["RANK"]) if "RANK" in os.environ else None
    if world_size is None and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    maps = {peer: {_device(k): _device(v) for k, v in m.items()} for peer, m in opts.device_maps.items()}
    _agent = _sluice._Agent(
        name,
        rank,
        world_size,
        store,
        float(opts.rpc_timeout),
        maps or None,
        opts.transports,
        opts.channels,
        opts.num_worker_threads,
        opts.listen,
    )


@atexit.register
def _at_exit():
    # A process that exits without shutdown() leaves its peers at once (no graceful wait),
    # before the interpreter goes away under the agent's threads.
    global _agent
    if _agent is not None:
        agent, _agent = _agent, None
        agent.shutdown(False)


def shutdown(graceful: bool = True, timeout: Optional[float] = None) -> None:
    """Graceful: waits until every worker has finished its outstanding work, then stops."""
    global _agent
    agent = _require_agent()
    try:
        agent.shutdown(graceful, timeout)
    finally:
        _agent = None


def get_worker_info(worker_name: Optional[str] = None) -> WorkerInfo:
    return WorkerInfo(*_require_agent().worker(worker_name))


def _get_current_rpc_agent():
    return _require_agent()


# --- pickling with tensors and RRefs lifted out --------------------------------------------


class _Pickler(pickle.Pickler):
    """Pickles with every tensor and RRef lifted out (into ``tensors`` and ``rrefs``).

    ``reducer_override`` is consulted for objects that are not plain builtins (functions,
    classes, tensors, ...), so ordinary arguments pickle at the C pickler's speed.
    """

    def __init__(self):
        self.buffer = io.BytesIO()
        super().__init__(self.buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = []
        self.rrefs = []
        self.busy = False

    def reducer_override(self, obj):
        t = type(obj)
        if t is RRef:
            self.rrefs.append(obj._native)
            return _rref, (len(self.rrefs) - 1,)
        if hasattr(t, "__dlpack__"):
            self.tensors.append(sendable(obj))
            return _tensor, (len(self.tensors) - 1,)
        return NotImplemented


_local = threading.local()


def _tensor(i):
    return from_dlpack(_local.received[0][i])


def _rref(i):
    return RRef._wrap(_local.received[1][i])


# Values that pickle the same with or without the tensor- and RRef-lifting pickler: None or an
# exact builtin scalar, or an exact tuple, list or dict (scalar keys) of at most 16 plain
# items, three levels deep. The binding's test (a Python one walked every call's arguments).
_plain = _sluice._plain


def _pack(obj):
    """``obj`` as (pickle bytes, [tensors], [native RRefs])."""
    if _plain(obj):
        # Nothing to lift out: the C pickler alone, without the Python-level override.
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), [], []
    p = getattr(_local, "pickler", None)
    if p is None or p.busy:
        p = _Pickler()
        if getattr(_local, "pickler", None) is None:
            _local.pickler = p
    p.busy = True
    try:
        p.buffer.seek(0)
        p.buffer.truncate()
        p.clear_memo()
        p.tensors, p.rrefs = [], []
        p.dump(obj)
        return p.buffer.getvalue(), p.tensors, p.rrefs
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise type(e)(f"cannot pickle for RPC: {e}") from e
    finally:
        p.busy = False
        p.tensors, p.rrefs = [], []


def _request(to, func, args, kwargs, timeout):
    """The request the agent sends for a call of ``func(*args, **kwargs)`` on ``to``: the
    destination, the handler, the callee's pace key, the pickled ``(func, args, kwargs)`` (the
    function by reference where it can be, see ``_ref``; for a call by reference without
    arguments, the reference alone) with the tensors and RRefs lifted out of it, and the
    timeout."""
    try:
        ref, handler, key, bare = _meta[func]
    except (KeyError, TypeError):
        ref, handler, key, bare = _meta_of(func)
    if bare is not None and not args and not kwargs:
        data, tensors, rrefs = bare, (), ()
    else:
        call = (ref, tuple(args) if args else (), kwargs or {})
        if bare is not None and (not args or _plain(call[1])) and (not kwargs or _plain(kwargs)):
            data, tensors, rrefs = pickle.dumps(call, pickle.HIGHEST_PROTOCOL), (), ()
        else:
            data, tensors, rrefs = _pack(call)
    return (to, handler, key, data, tensors, rrefs, None if timeout == -1.0 else _timeout(timeout))


def _unpack(data, tensors, rrefs):
    if not tensors and not rrefs:
        # Nothing lifted out, nothing for `_tensor`/`_rref` to find.
        return pickle.loads(data)
    previous = getattr(_local, "received", None)
    _local.received = (tensors, rrefs)
    try:
        return pickle.loads(data)
    finally:
        _local.received = previous


# The reply path's unpickler when nothing was lifted out, and the result path's pickler for
# plain scalars (both called from the binding).
_loads = pickle.loads
_dumps = functools.partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)


def _unpack_tuple(t):
    return _unpack(*t)


# --- what the callee runs ------------------------------------------------------------------


def _serve_call(data, tensors, rrefs):
    if data[:1] != _PICKLED:
        # A function by reference, called without arguments (see `_meta_of`).
        return _callee_function(data)()
    try:
        func, args, kwargs = _unpack(data, tensors, rrefs)
    except Exception as e:
        raise _cannot_load(e) from e
    if type(func) is str:
        func = _callee_function(func)
    return func(*args, **kwargs)


# Every pickle made here opens with protocol 2+'s PROTO opcode; a reference string never does.
_PICKLED = b"\x80"


def _callee_function(ref):
    """The function a call to run here names by reference (a str; bytes: the whole call, one
    without arguments), or the error the caller gets."""
    try:
        return _function(ref.decode() if type(ref) is bytes else ref)
    except Exception as e:
        raise _cannot_load(e) from e


def _callee_function_kept(ref):
    """``(_callee_function(ref), whether ref is the name its callers send)``: the binding
    keeps only those, one per function, as ``_function`` does."""
    func = _callee_function(ref)
    return func, ref.decode() in _resolved


def _cannot_load(e):
    return RuntimeError(f"{_me()} cannot load the call: {type(e).__name__}: {e}")


# --- functions named by reference ------------------------------------------------------------
#
# A plain function (or builtin) that its module exposes under its qualified name travels as the
# string "module:qualname", which the callee resolves once and caches: what pickle would do
# (it too names such functions by module and name, and the callee imports them), without
# pickling and importing on every call. Anything else (lambdas, closures, bound methods,
# callable objects) is pickled with the call as before.

_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType)
_meta = {}
_resolved = {}


def _lookup(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _meta_of(func):
    """What a call of ``func`` sends besides its arguments: ``(_ref(func), _handler(func),
    _key(func), the bytes of a call without arguments, or None)``. Kept for a function that
    travels by reference (one its module names: a bounded set, whose handler only the
    ``async_execution`` decorator changes, at definition); anything else (lambdas made per
    call, bound methods, callable objects) is worked out per call and never kept alive here."""
    ref = _ref(func)
    if type(ref) is not str:
        return ref, _handler(func), _key(func), None
    # The call without arguments (a getter's every call) is the reference alone, not a pickle:
    # the callee resolves it once and calls the function with nothing to unpickle. (A name
    # that is not valid UTF-8, a lone surrogate, is pickled as any call is.)
    try:
        bare = ref.encode()
    except UnicodeEncodeError:
        bare = pickle.dumps((ref, (), {}), pickle.HIGHEST_PROTOCOL)
    m = _meta[func] = (ref, _handler(func), _key(func), bare)
    return m


def _ref(func):
    """``func``'s reference string, or ``func`` itself when it cannot travel by reference."""
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None)
    if (
        isinstance(func, _FUNCTION_TYPES)
        and isinstance(module, str)
        and isinstance(qualname, str)
        and "<" not in qualname
    ):
        try:
            if _lookup(module, qualname) is func:
                return f"{module}:{qualname}"
        except Exception:
            pass
    return func


def _function(ref):
    """The function a reference string names (callee side), cached."""
    try:
        return _resolved[ref]
    except KeyError:
        pass
    module, sep, qualname = ref.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"not a function reference: {ref!r}")
    func = _lookup(module, qualname)
    if not callable(func):
        raise TypeError(f"{ref} is not callable")
    # Kept under the one name a caller sends for it (`_ref`), so a peer cannot grow the cache
    # with aliases (`os:getcwd`, `posix:getcwd`) or attribute chains; others resolve each time.
    if _ref(func) == ref:
        _resolved[ref] = func
    return func


def _serve_method(target, data, tensors, rrefs):
    name, args, kwargs = _unpack(data, tensors, rrefs)
    return getattr(target, name)(*args, **kwargs)


def _me():
    try:
        return get_worker_info().name
    except Exception:
        return "this worker"


def _describe(exc, tb=None):
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = exc.args[0]
    else:
        text = str(exc)
    tb = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    return kind, f"{text}{_TRACEBACK}{tb}"


def _resolve(kind):
    module, _, qualname = kind.partition(".")
    # The module is the longest importable prefix (packages have dots too).
    parts = kind.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return obj
        return None
    return None


def _remote_error(kind, message, worker):
    """The exception a callee raised, rebuilt: same type, its message, the remote traceback
    attached (as a note, and as ``remote_traceback``)."""
    text, _, tb = message.partition(_TRACEBACK)
    cls = _resolve(kind)
    exc = None
    if cls is not None:
        try:
            exc = cls(text)
        except Exception:
            exc = None
    if exc is None:
        exc = RpcError(f"{kind} on {worker}: {text}")
    exc.remote_traceback = tb
    exc.worker = worker
    if tb and hasattr(exc, "add_note"):
        exc.add_note(f"Raised on {worker}; remote traceback:\n{tb}")
    return exc


# --- futures ---------------------------------------------------------------------------------


class Future:
    """The result of an asynchronous call, like ``torch.futures.Future``: ``wait``, ``value``,
    ``done``, ``then``, ``add_done_callback``, ``set_result``; awaitable from asyncio."""

    def __init__(self, *, _native=None, _decode=None):
        self._native = _native
        self._decode = _decode
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._done = False
        self._hooked = False
        self._value = None
        self._exc = None
        self._callbacks = []

    def done(self) -> bool:
        return self._done or (self._native is not None and self._native.done())

    def _take_native(self, timeout=None):
        try:
            value = self._decode(self._native.wait(timeout))
        except RpcTimeout:
            if timeout is not None:
                raise
            self._settle(None, _current_exception())
            return
        except BaseException as e:  # noqa: BLE001 - the callee's exception, whatever it is
            self._settle(None, e)
            return
        self._settle(value, None)

    def wait(self, timeout: Optional[float] = None):
        """Blocks (GIL released) until the result is there; returns it or raises its error."""
        if not self._done:
            if self._native is not None:
                self._take_native(timeout)
            elif not self._event.wait(timeout):
                raise RpcTimeout(f"no result within {timeout} s")
        if self._exc is not None:
            raise self._exc
        return self._value

    def value(self):
        if not self.done():
            raise RuntimeError("the future is not done yet")
        return self.wait()

    def set_result(self, result) -> None:
        if not self._settle(result, None):
            raise RuntimeError("the future already has a result")

    def set_exception(self, exc) -> None:
        if not self._settle(None, exc):
            raise RuntimeError("the future already has a result")

    def _settle(self, value, exc) -> bool:
        with self._lock:
            if self._done:
                return False
            self._value, self._exc, self._done = value, exc, True
            callbacks, self._callbacks = self._callbacks, []
            self._event.set()
        for cb in callbacks:
            _run_callback(cb, self)
        return True

    def add_done_callback(self, callback) -> None:
        """Calls ``callback(self)`` once done (at once if it already is)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                hook = self._native is not None and not self._hooked
                self._hooked = True
            else:
                hook = None
        if hook is None:
            _run_callback(callback, self)
        elif hook:
            self._native.add_done_callback(self._take_native)

    def then(self, callback) -> "Future":
        """A future of ``callback(self)``, run once this one is done."""
        chained = Future()

        def run(f):
            try:
                chained.set_result(callback(f))
            except BaseException as e:  # noqa: BLE001
                chained.set_exception(e)

        self.add_done_callback(run)
        return chained

    def __await__(self):
        loop = asyncio.get_running_loop()
        aio = loop.create_future()

        def copy(f):
            loop.call_soon_threadsafe(_copy_into_asyncio, f, aio)

        self.add_done_callback(copy)
        return aio.__await__()


def _current_exception():
    import sys

    return sys.exc_info()[1]


def _run_callback(cb, fut):
    try:
        cb(fut)
    except Exception:  # noqa: BLE001 - a callback's failure must not break the others
        traceback.print_exc()


def _copy_into_asyncio(f, aio):
    if aio.done():
        return
    if f._exc is not None:
        aio.set_exception(f._exc)
    else:
        aio.set_result(f._value)


# --- calls -----------------------------------------------------------------------------------


def _key(func):
    """The callee's pace key: which function this is (the callee runs functions it has not
    seen be quick as work that may block)."""
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__qualname__)}"


def _handler(func):
    return "py.call_async" if getattr(func, "_sluice_async_execution", False) else "py.call"


def _timeout(timeout):
    """Seconds, None for the default (negative too, as in PyTorch); 0 and inf mean none."""
    if timeout is None:
        return None
    timeout = float(timeout)
    if timeout != timeout:
        raise ValueError("timeout is NaN")
    if timeout < 0:
        return None
    return 0.0 if timeout == float("inf") else timeout


PRIORITY_LOWEST = -8
PRIORITY_LOW = -4
PRIORITY_NORMAL = 0
PRIORITY_HIGH = 4
PRIORITY_HIGHEST = 7


@contextlib.contextmanager
def priority(level: int):
    """Calls made by this thread inside the block go at ``level`` (-8..7; 0 is normal): a
    busy callee serves higher levels first, and calls above normal travel on an express pipe
    that bulk transfers do not hold up. Every call form is covered (``rpc_sync``,
    ``rpc_async``, ``remote``, ``RRef.to_here`` and the proxies); functions run by a callee
    inherit their request's level for the calls they make. The level belongs to the thread:
    in asyncio code, where coroutines share one thread, give ``priority=`` to each call
    instead of holding a block across an ``await``."""
    previous = _sluice._set_priority(int(level))
    try:
        yield
    finally:
        _sluice._set_priority(previous)


def current_priority() -> int:
    """The level calls made by this thread get now (inside a function run by a callee: its
    request's level)."""
    return _sluice._current_priority()


def _at(level):
    return contextlib.nullcontext() if level is None else priority(level)


def rpc_sync(to, func, args=None, kwargs=None, timeout: float = -1.0, priority: Optional[int] = None):
    """Runs ``func(*args, **kwargs)`` on ``to`` (a name, rank or WorkerInfo) and returns its
    result. ``timeout`` in seconds; negative: the default; 0: none. ``priority``: this call's
    level (see ``priority()``); None: the thread's."""
    request = _request(to, func, args, kwargs, timeout)
    agent = _agent if _agent is not None else _require_agent()
    if priority is None:
        return agent.call_sync(request)
    with _at(priority):
        return agent.call_sync(request)


def rpc_async(to, func, args=None, kwargs=None, timeout: float = -1.0, priority: Optional[int] = None) -> Future:
    """Like ``rpc_sync``, returning a ``Future`` at once."""
    request = _request(to, func, args, kwargs, timeout)
    with _at(priority):
        native = _require_agent().call(request)
    return Future(_native=native, _decode=_unpack_tuple)


def remote(to, func, args=None, kwargs=None, timeout: float = -1.0, priority: Optional[int] = None) -> "RRef":
    """Runs ``func`` on ``to``, which keeps the result (as the object itself) and owns it;
    returns a reference at once."""
    request = _request(to, func, args, kwargs, timeout)
    with _at(priority):
        native = _require_agent().remote(request)
    return RRef._wrap(native)


def async_execution(fn):
    """Marks a function that returns a ``Future``: the callee replies when the future
    completes, holding no thread meanwhile (PyTorch's ``@rpc.functions.async_execution``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper._sluice_async_execution = True
    return wrapper


class functions:  # noqa: N801 - mirrors torch.distributed.rpc.functions
    async_execution = staticmethod(async_execution)


# --- RRefs -----------------------------------------------------------------------------------


class RRef:
    """A reference to a value owned by some worker. ``RRef(value)`` makes one owned here."""

    __slots__ = ("_native",)

    def __init__(self, value=None):
        self._native = _require_agent().rref(value)

    @classmethod
    def _wrap(cls, native):
        r = cls.__new__(cls)
        r._native = native
        return r

    def owner(self) -> WorkerInfo:
        return WorkerInfo(*self._native.owner())

    def owner_name(self) -> str:
        return self._native.owner()[0]

    def is_owner(self) -> bool:
        return self._native.is_owner()

    def confirmed_by_owner(self) -> bool:
        return self._native.confirmed_by_owner()

    def local_value(self):
        """The value itself; only on its owner."""
        return self._native.local_value()

    def to_here(self, timeout: float = -1.0):
        """A copy of the value, fetched from its owner."""
        t = _timeout(timeout)
        if t is None:
            t = _require_agent().default_timeout
        try:
            return Future(_native=self._native.fetch(t), _decode=_unpack_tuple).wait()
        except RpcError:
            # A value that was never created: raise what kept it from existing (the
            # callee's own exception), not the owner's report of it.
            self._native.wait_created()
            raise

    def rpc_sync(self, timeout: float = -1.0):
        """A proxy: ``rref.rpc_sync().method(*args)`` runs ``method`` on the owner."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1.0):
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = -1.0):
        return _Proxy(self, "remote", timeout)

    def __reduce__(self):
        raise TypeError("an RRef can only be pickled inside an RPC's arguments or result")

    def __repr__(self):
        return f"RRef({self._native!r})"


class _Proxy:
    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref, mode, timeout):
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name):
        rref, mode = self._rref, self._mode
        t = _timeout(self._timeout)
        if t is None:
            t = _require_agent().default_timeout

        key = f"{type(rref).__name__}.{name}"

        def call(*args, **kwargs):
            data, tensors, rrefs = _pack((name, args, kwargs))
            if mode == "remote":
                return RRef._wrap(rref._native.remote_method(key, data, tensors, rrefs, t))
            fut = Future(_native=rref._native.method(key, data, tensors, rrefs, t), _decode=_unpack_tuple)
            return fut.wait() if mode == "sync" else fut

        return call


__all__ = [
    "PRIORITY_HIGH",
    "PRIORITY_HIGHEST",
    "PRIORITY_LOW",
    "PRIORITY_LOWEST",
    "PRIORITY_NORMAL",
    "Future",
    "RRef",
    "RpcBackendOptions",
    "RpcError",
    "RpcTimeout",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "async_execution",
    "functions",
    "get_worker_info",
    "current_priority",
    "init_rpc",
    "priority",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
