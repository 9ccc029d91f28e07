"""Remote tensors: values that live on another worker.

``RemoteTensor.place(array, "worker1/cpu")`` (or ``sluice.remote.to``) puts a NumPy array (or
anything ``numpy.asarray`` takes: a CPU torch tensor, a list) on worker1. Operations on remote
tensors of one owner are *recorded*, with shapes and dtypes checked where they are written
(a mistake raises ``ValueError`` on that line); the owner runs them as one call when a value is
needed (``to_here()``, ``item()``, ``str()``), when an operation mixes owners, on ``sync()``,
or at the recording's size bound. A tensor moved to another owner (``.to("worker2/cpu")``)
travels owner to owner. This is the Rust ``RemoteTensor`` (README, "Remote tensors").

Training runs on the owners, under distributed autograd::

    w = remote.parameter(w0, "worker1/cpu", "w")
    opt = remote.DistributedOptimizer([w], "sgd", lr=0.1)
    with remote.context() as ctx:
        y = remote.to(x, "worker1/cpu").linear(w)
        loss = (y * y).mean()
        opt.backward_and_step(ctx, loss)     # or: ctx.backward(loss); opt.step(ctx)

Gradients accumulate in the context on the parameters' owners and the optimizer applies them
there; ``ctx.gradient(w)`` reads one back (a NumPy array, one call to ``w``'s owner).

Any worker started with ``sluice.rpc.init_rpc`` can own remote tensors, Python or Rust.
"""

from numbers import Number

import numpy as np

from . import _sluice, rpc

__all__ = ["DistributedOptimizer", "RemoteTensor", "cat", "context", "parameter", "to"]

_DTYPES = {np.dtype("float32"), np.dtype("float64"), np.dtype("int64")}


def to(array, placement):
    """``array`` placed on ``placement`` (``"worker1/cpu"``): a :class:`RemoteTensor`."""
    return RemoteTensor.place(array, placement)


def _array(array):
    """``array`` as a C-contiguous NumPy array of a dtype remote tensors hold."""
    if hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu().numpy()
    a = np.asarray(array)
    if not a.flags.c_contiguous:  # ascontiguousarray would make a 0-d array 1-d
        a = a.copy(order="C")
    if a.dtype not in _DTYPES:
        raise ValueError(f"remote tensors from Python hold float32, float64 or int64, not {a.dtype}")
    return a


def _numpy(data, shape, dtype):
    """Bytes from the native side as a NumPy array (a copy that owns its memory)."""
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()


def parameter(array, placement, name):
    """A trainable parameter named ``name``, made on ``placement`` from ``array`` (float32 or
    float64): its gradients accumulate on its owner, where :class:`DistributedOptimizer`
    updates it. ``to_here()`` reads its current value."""
    a = _array(array)
    native = _sluice._remote_tensor(
        rpc._require_agent(), a.tobytes(), list(a.shape), a.dtype.newbyteorder("<").str, placement, name
    )
    return RemoteTensor(native)


class context:
    """A distributed autograd context (PyTorch's ``dist_autograd.context()``), entered on this
    thread: remote tensors flushed inside it are recorded in it. Leaving it releases it on
    every worker it reached. It belongs to the thread that entered it: use and leave it there
    (PyO3 refuses it on another thread)."""

    __slots__ = ("_c",)

    def __init__(self):
        self._c = None

    def __enter__(self):
        self._c = _sluice._DistContext(rpc._require_agent())
        return self

    def __exit__(self, *exc):
        self._c.leave()
        return False

    def _entered(self):
        if self._c is None:
            raise RuntimeError("this autograd context was never entered: use `with sluice.remote.context() as ctx:`")
        return self._c

    @property
    def id(self):
        return self._entered().id

    def backward(self, *losses):
        """The distributed backward from one-element remote ``losses``: gradients accumulate
        in this context on the parameters' owners."""
        self._entered().backward([loss._t for loss in losses])


    def gradient(self, param):
        """The gradient remote parameter ``param`` accumulated in this context on its owner,
        read from there as a NumPy array (one call), or ``None`` when the backwards in this
        context reached no use of it. Only a parameter keeps a gradient: any other remote
        tensor raises ``ValueError``."""
        g = self._entered().gradient(param._t)
        return None if g is None else _numpy(*g)


class DistributedOptimizer:
    """An optimizer on every owner of ``params`` (remote parameters from :func:`parameter`):
    ``optimizer`` ``"sgd"`` (with ``momentum``) or ``"adam"``; ``mode`` ``"locked"`` or
    ``"hogwild"``."""

    __slots__ = ("_o",)

    def __init__(self, params, optimizer="sgd", lr=0.01, momentum=0.0, mode="locked"):
        self._o = _sluice._DistributedOptimizer(
            rpc._require_agent(), [p._t for p in params], optimizer, float(lr), float(momentum), mode
        )

    def step(self, ctx):
        """Every owner steps with the gradients of context ``ctx``."""
        self._o.step(ctx._entered())

    def backward_and_step(self, ctx, *losses):
        """``ctx.backward(*losses)`` then ``step(ctx)``, with owners stepping before they
        answer the backward where they can tell their gradients are final (one call fewer)."""
        self._o.backward_and_step(ctx._entered(), [loss._t for loss in losses])


def cat(tensors, dim=0):
    """Concatenation along ``dim`` of remote tensors of one owner and device."""
    return RemoteTensor(_sluice._RemoteTensor.cat([t._t for t in tensors], dim))


class RemoteTensor:
    """A tensor whose value lives on another worker (see the module's docs)."""

    __slots__ = ("_t",)

    def __init__(self, native):
        self._t = native

    @staticmethod
    def place(array, placement):
        a = _array(array)
        native = _sluice._remote_tensor(
            rpc._require_agent(), a.tobytes(), list(a.shape), a.dtype.newbyteorder("<").str, placement
        )
        return RemoteTensor(native)

    # Where it is and what it is (no call).
    @property
    def shape(self):
        return tuple(self._t.shape)

    @property
    def dtype(self):
        return np.dtype(self._t.dtype)

    @property
    def placement(self):
        return self._t.placement

    def is_pending(self):
        """Still only recorded (not yet sent to its owner)."""
        return self._t.is_pending()

    def __repr__(self):
        state = "recorded" if self.is_pending() else "stored"
        return f"RemoteTensor(shape={self.shape}, dtype={self.dtype}, on {self.placement}, {state})"

    def __str__(self):
        return f"{self.to_here()!s} (on {self.placement})"

    # Flush points.
    def to_here(self):
        """The value here, as a NumPy array."""
        return _numpy(*self._t.to_here())

    numpy = to_here

    def item(self):
        return self._t.item()

    def sync(self):
        """Sends the owner's recording if this tensor is in it; waits until the owner holds it."""
        self._t.sync()
        return self

    def to(self, placement):
        return RemoteTensor(self._t.to(placement))

    # Recorded operations.
    def _binary(self, name, other):
        return RemoteTensor(self._t.binary(name, self._remote_operand(name, other)))

    @staticmethod
    def _remote_operand(name, other):
        if not isinstance(other, RemoteTensor):
            raise TypeError(f"{name} of a RemoteTensor and {type(other).__name__}: place it with sluice.remote.to first")
        return other._t

    def _unary(self, name):
        return RemoteTensor(self._t.unary(name))

    def add(self, other):
        if isinstance(other, Number):
            return RemoteTensor(self._t.add_scalar(float(other)))
        return self._binary("add", other)

    def sub(self, other):
        if isinstance(other, Number):
            return RemoteTensor(self._t.add_scalar(-float(other)))
        return self._binary("sub", other)

    def mul(self, other):
        if isinstance(other, Number):
            return RemoteTensor(self._t.mul_scalar(float(other)))
        return self._binary("mul", other)

    def div(self, other):
        if isinstance(other, Number):
            return RemoteTensor(self._t.mul_scalar(1.0 / float(other)))
        return self._binary("div", other)

    __add__ = add
    __sub__ = sub
    __mul__ = mul
    __truediv__ = div

    def __radd__(self, other):
        return self.add(other)

    def __rmul__(self, other):
        return self.mul(other)

    def __rsub__(self, other):
        return self.neg().add(other)

    def __neg__(self):
        return self.neg()

    def __matmul__(self, other):
        return self.matmul(other)

    def matmul(self, other):
        return self._binary("matmul", other)

    def linear(self, weight, bias=None):
        """``self · weightᵀ + bias``."""
        return RemoteTensor(self._t.linear(weight._t, None if bias is None else bias._t))

    def transpose(self, d0, d1):
        return RemoteTensor(self._t.transpose(d0, d1))

    def t(self):
        if len(self.shape) != 2:
            raise ValueError(f"t() of a {len(self.shape)}-d tensor")
        return self.transpose(0, 1)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        return RemoteTensor(self._t.reshape(list(shape)))

    def sum(self, dim=None, keepdim=False):
        return RemoteTensor(self._t.sum(dim, keepdim))

    def mean(self, dim=None, keepdim=False):
        return RemoteTensor(self._t.mean(dim, keepdim))

    def softmax(self, dim):
        return RemoteTensor(self._t.softmax(dim))

    def log_softmax(self, dim):
        return RemoteTensor(self._t.log_softmax(dim))

    def narrow(self, dim, start, length):
        return RemoteTensor(self._t.narrow(dim, start, length))

    def index_select(self, dim, indices):
        """The slices along ``dim`` (negative: from the end) at int64 ``indices`` (1-d), as
        ``torch.index_select``. CPU placements only; 0-d tensors are refused (torch reads
        them as 1-d)."""
        return RemoteTensor(self._t.index_select(dim, self._remote_operand("index_select", indices)))

    def gather(self, dim, index):
        """Elements along ``dim`` (negative: from the end) picked by the int64 ``index`` (as
        many dimensions as this tensor), as ``torch.gather``: ``index``'s shape. CPU placements
        only; 0-d tensors are refused (torch reads them as 1-d)."""
        return RemoteTensor(self._t.gather(dim, self._remote_operand("gather", index)))

    def embedding(self, indices):
        """Rows of this weight (``[vocab, dim]``) picked by int64 ``indices``."""
        return self._binary("embedding", indices)

    def mse_loss(self, target):
        return self._binary("mse_loss", target)

    def cross_entropy(self, targets):
        """Mean cross-entropy of these logits (N × C) against int64 class indices (N)."""
        return self._binary("cross_entropy", targets)


def _unary(name):
    def op(self):
        return self._unary(name)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Elementwise {name}, recorded on the owner."
    return op


for _name in ("neg", "exp", "log", "tanh", "sigmoid", "relu", "sin", "cos"):
    setattr(RemoteTensor, _name, _unary(_name))
del _name
