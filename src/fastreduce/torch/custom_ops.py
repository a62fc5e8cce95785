"""fastreduce's torch operations as torch.library custom ops, so torch.compile traces them.

Custom ops take tensors, numbers and strings, not communicators: a call names its
communicator by a small integer from `comm_id(comm)` (a process-local registry that keeps
the mpi4py object), the way torch's functional collectives name a process group by a
registered string. The layers (fastreduce.nn, fastreduce.autograd) call these ops only
while dynamo is tracing; eager calls keep their direct path into the core::

    torch.ops.fastreduce.allreduce(x, "sum", comm_id(comm))      # new tensor
    torch.ops.fastreduce.allreduce_(x, "sum", comm_id(comm))     # in place
    torch.ops.fastreduce.all_sum_reduce(x, comm_id(comm))        # self-adjoint backward
    torch.ops.fastreduce.all_reduce(x, op, comm_id(comm), reduce_grad)
                                                 # backward: identity, or the same all-reduce

Every op is tagged cudagraph_unsafe: inductor never records an MPI call into a CUDA graph
(mode="reduce-overhead" leaves the graphs that hold one uncaptured); the core's stream
capture check is the backstop.
"""

from __future__ import annotations

import weakref

import torch
from mpi4py import MPI

from ..backend import buffer as _buffer
from ..backend import collectives as _collectives
from ..backend.collectives import default_comm
from .versions import _release

__all__ = ["allreduce", "allreduce_", "comm_id", "communicator"]

_comms: list[weakref.ref] = []    # number -> the communicator (weakly: dropping it frees it)
_ids: dict[int, int] = {}          # id(communicator object) -> number, while it lives
_keys: dict[int, int] = {}         # number -> id(communicator object), while it lives


def _forget(number: int) -> None:
    key = _keys.pop(number, None)
    if _ids.get(key) == number:
        del _ids[key]


def comm_id(comm: MPI.Comm | None = None) -> int:
    """The number custom ops name `comm` by (registered at the first call; the default
    communicator when None). Numbers are never reused; the registry holds the communicator
    weakly, so one registered and dropped costs a dead entry of about 100 bytes."""
    comm = default_comm() if comm is None else comm
    found = _ids.get(id(comm))
    if found is not None and _comms[found]() is comm:
        return found
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"fastreduce: a communicator must be an mpi4py Comm, not "
                        f"{type(comm).__qualname__}")
    # No lock (dynamo cannot trace one, and the layers may register while tracing): under
    # the GIL two threads registering one communicator at once at worst give it two numbers.
    number = len(_comms)
    _comms.append(weakref.ref(comm, lambda _, number=number: _forget(number)))
    _keys[number] = id(comm)
    _ids[id(comm)] = number
    return number


@torch.compiler.assume_constant_result
def comm_constant(_identity: int, comm: MPI.Comm | None) -> tuple:
    """(comm_id(comm), its size), computed once while dynamo traces and kept in the graph
    as constants; callers pass id(comm) first, which makes dynamo guard on the object."""
    comm = default_comm() if comm is None else comm
    return comm_id(comm), comm.Get_size()


def communicator(number: int) -> MPI.Comm:
    """The communicator comm_id() gave `number` to."""
    comm = _comms[number]() if 0 <= number < len(_comms) else None
    if comm is None:
        raise ValueError(f"fastreduce: no live communicator is registered as {number} (never "
                         f"registered, or dropped since); name communicators with "
                         f"fastreduce.ops.comm_id(comm)")
    return comm


# Whether torch.compile traces fastreduce's ops and layers (torch 2.12 and newer: older
# dynamo cannot trace the communicator handling). With older torch, compiled code runs the
# layers eagerly, with a graph break around each (fullgraph=True refuses that).
TRACEABLE = _release(torch.__version__) >= (2, 12)


# torch without the DLPack C exchange API (2.9 and older) reaches the core through
# Tensor.__dlpack__, which refuses a tensor that requires grad: give it a detached view.
_DETACH = not hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def _reduced(x: torch.Tensor, op: str, number: int) -> torch.Tensor:
    """A new tensor: x reduced over the communicator (x made contiguous first if it is not)."""
    comm = communicator(number)
    if _DETACH and x.requires_grad:
        x = x.detach()
    return _collectives.allreduce(x if x.is_contiguous() else x.contiguous(), op, comm=comm)


def _number(comm: MPI.Comm | None) -> int:
    if TRACEABLE and torch.compiler.is_dynamo_compiling():
        return comm_constant(id(comm), comm)[0]
    return comm_id(comm)


def allreduce(x: torch.Tensor, op: str = "sum", *, comm: MPI.Comm | None = None):
    """fastreduce.allreduce of a torch tensor as a custom op (traceable; a new tensor)."""
    return torch.ops.fastreduce.allreduce(x, op, _number(comm))


def allreduce_(x: torch.Tensor, op: str = "sum", *, comm: MPI.Comm | None = None):
    """`fastreduce.allreduce_` of a torch tensor as a custom op (traceable; in place)."""
    torch.ops.fastreduce.allreduce_(x, op, _number(comm))
    return x


# The ops are defined with torch.library.Library and Python kernels for CPU and CUDA rather
# than with torch.library.custom_op, whose extra Python layers cost about 3 us a call more.
_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
_lib = torch.library.Library("fastreduce", "DEF")  # noqa: TOR901 (kept for the process)


# Layouts the ops do not reduce: their kernel gives fastreduce's error naming the layout
# and the fix, instead of the dispatcher's "Could not run ... with arguments from ...".
_REFUSED_KEYS = [kind + device for kind in ("Sparse", "SparseCsr", "Quantized", "NestedTensor")
                 for device in ("CPU", "CUDA")] + ["AutogradNestedTensor"]
# torch's own handling of conjugate and negative views around an op expects an in-place op
# to return its argument; the core resolves such views itself (see fastreduce.backend.buffer).
_LAZY_KEYS = ("Conjugate", "Negative")


def _refuse(x, *args):
    _buffer.check_readable(x)
    raise TypeError(f"fastreduce: x has layout {x.layout}; pass a dense tensor")


def _define(schema: str, kernel) -> None:
    name = schema.split("(", 1)[0]
    _lib.define(schema, tags=_UNSAFE)
    for device in ("CPU", "CUDA"):
        _lib.impl(name, kernel, device)
    for key in _REFUSED_KEYS:
        _lib.impl(name, _refuse, key)
    for key in _LAZY_KEYS:
        _lib.impl(name, kernel, key)


def _new_like(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --- all-reduce of a tensor: out of place and in place (no autograd formula) ------------

def _allreduce_kernel(x: torch.Tensor, op: str, comm: int) -> torch.Tensor:
    return _reduced(x, op, comm)


def _allreduce_inplace_kernel(x: torch.Tensor, op: str, comm: int) -> None:
    _collectives.allreduce_(x, op, comm=communicator(comm))


_define("allreduce(Tensor x, str op, int comm) -> Tensor", _allreduce_kernel)
torch.library.register_fake("fastreduce::allreduce", _new_like, lib=_lib)
_define("allreduce_(Tensor(a!) x, str op, int comm) -> ()", _allreduce_inplace_kernel)
torch.library.register_fake("fastreduce::allreduce_", lambda x, op, comm: None, lib=_lib)


# --- the differentiable layers' reductions --------------------------------------------

def _all_sum_reduce_kernel(x: torch.Tensor, comm: int) -> torch.Tensor:
    return _reduced(x, "sum", comm)


def _sum_setup(ctx, inputs, output):
    ctx.comm = inputs[1]


def _sum_backward(ctx, grad):
    return torch.ops.fastreduce.all_sum_reduce(grad, ctx.comm), None  # self-adjoint


_define("all_sum_reduce(Tensor x, int comm) -> Tensor", _all_sum_reduce_kernel)
torch.library.register_fake("fastreduce::all_sum_reduce", _new_like, lib=_lib)
torch.library.register_autograd("fastreduce::all_sum_reduce", _sum_backward,
                                setup_context=_sum_setup, lib=_lib)


def _all_reduce_kernel(x: torch.Tensor, op: str, comm: int, reduce_grad: bool) -> torch.Tensor:
    return _reduced(x, op, comm)


def _tp_setup(ctx, inputs, output):
    _, ctx.op, ctx.comm, ctx.reduce_grad = inputs


def _tp_backward(ctx, grad):
    if ctx.reduce_grad:
        grad = torch.ops.fastreduce.all_reduce(grad, ctx.op, ctx.comm, True)
    return grad, None, None, None


_define("all_reduce(Tensor x, str op, int comm, bool reduce_grad) -> Tensor", _all_reduce_kernel)
torch.library.register_fake("fastreduce::all_reduce", _new_like, lib=_lib)
torch.library.register_autograd("fastreduce::all_reduce", _tp_backward, setup_context=_tp_setup,
                                lib=_lib)
