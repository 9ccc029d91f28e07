"""Functions the RPC tests call by reference (importable on every worker)."""

import threading
import time

import numpy as np
import torch

from sluice import rpc


def noop():
    return None


def add(a, b):
    return a + b


def echo(*args, **kwargs):
    return args, kwargs


def scale(t, k):
    return t * k


def boom(message):
    raise ValueError(message)


class CustomError(Exception):
    pass


def custom_boom():
    raise CustomError("a custom exception type survives the trip")


def key_error():
    return {}["missing"]


def sleep(seconds):
    time.sleep(seconds)
    return seconds


def unpicklable_result():
    return lambda: None


def whoami():
    return rpc.get_worker_info().name


alias_of_whoami = whoami


def resolved_refs():
    return sorted(rpc._resolved)


def data_ptr_of(t):
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.__array_interface__["data"][0]


class Counter:
    def __init__(self, start=0):
        self.n = start
        self.lock = threading.Lock()

    def inc(self, k=1):
        with self.lock:
            self.n += k
            return self.n

    def get(self):
        return self.n

    def __getstate__(self):
        return {"n": self.n}

    def __setstate__(self, state):
        self.n = state["n"]
        self.lock = threading.Lock()

    def fail(self):
        raise KeyError("no such counter")


class ParameterServer:
    """Holds a weight; applies gradients pushed by trainers."""

    def __init__(self, n):
        self.w = torch.zeros(n, dtype=torch.float64)
        self.lock = threading.Lock()

    def __getstate__(self):
        return {"w": self.w}

    def weights(self):
        return self.w

    def push(self, grad, lr):
        with self.lock:
            self.w -= lr * grad
            return self.w.clone()


def fetch_via(rref):
    """Called with an RRef as its argument: reads through it from a third place."""
    return rref.to_here()


def sum_rref(rref):
    return rref.rpc_sync().get()


_timers = []  # (due, seq, fn), a heap served by one thread
_timers_cv = threading.Condition()


def _serve_timers():
    import heapq

    while True:
        with _timers_cv:
            while not _timers or _timers[0][0] > time.monotonic():
                _timers_cv.wait(None if not _timers else _timers[0][0] - time.monotonic())
            _, _, fn = heapq.heappop(_timers)
        fn()


def _later(delay, fn):
    """Runs fn after delay seconds on one shared thread (so pending replies add no threads)."""
    import heapq

    with _timers_cv:
        if not hasattr(_later, "thread"):
            _later.thread = threading.Thread(target=_serve_timers, daemon=True)
            _later.thread.start()
        heapq.heappush(_timers, (time.monotonic() + delay, next(_later_seq), fn))
        _timers_cv.notify()


_later_seq = iter(range(1 << 62))


def os_threads():
    """The callee process's threads, native ones included."""
    import os

    return len(os.listdir("/proc/self/task"))


@rpc.async_execution
def doubled_later(x, delay=0.05):
    fut = rpc.Future()
    _later(delay, lambda: fut.set_result(x * 2))
    return fut


@rpc.async_execution
def chained(to, x):
    # Replies once a nested call completes, holding no thread meanwhile.
    return rpc.rpc_async(to, add, (x, 1)).then(lambda f: f.wait() * 10)


@rpc.async_execution
def fails_later():
    fut = rpc.Future()
    threading.Timer(0.01, lambda: fut.set_exception(RuntimeError("failed asynchronously"))).start()
    return fut


def numpy_stats(a):
    return float(np.mean(a)), a.dtype.str


def my_priority():
    return rpc.current_priority()


def nested_priority(to):
    return rpc.rpc_sync(to, my_priority)


class Holder:
    """A function reached through a class: travels by reference as ``Holder.double``."""

    @staticmethod
    def double(x):
        return 2 * x


class Offset:
    """Its bound methods and the instance itself (callable) travel pickled, by value."""

    def __init__(self, n):
        self.n = n

    def get(self, k=0):
        return self.n + k

    def __call__(self, k):
        return self.n * k
