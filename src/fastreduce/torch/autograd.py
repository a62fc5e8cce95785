"""Differentiable all-reduces for torch, whose backward passes are the forward's adjoints.

`all_sum_reduce(x, P, axes)`: the sum of x over the workers of P's sub-partition
spanning `axes`, on each of them. Summing is self-adjoint: backward sums the
gradient the same way. `all_reduce(x, comm, op, backward)`: the tensor-parallel
all-reduce (Megatron's "g", TransformerEngine's AllReduce): backward is the
identity, or the same all-reduce of the gradient.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from .. import settings, watchdog
from ..backend.collectives import allreduce, default_comm
from ..partition import CartesianPartition, Partition
from .custom_ops import _DETACH, TRACEABLE, comm_constant, comm_id  # registers the custom ops

__all__ = ["all_reduce", "all_sum_reduce", "set_consistency_checks", "zero_volume_tensor"]

# Set by FASTREDUCE_CHECK_CONSISTENCY=1 or set_consistency_checks(True): before each
# reduction the layers compare dtype and shape across the communicator.
_check_consistency = settings.value("FASTREDUCE_CHECK_CONSISTENCY")


def set_consistency_checks(enabled: bool) -> bool:
    """Compare dtype and shape across ranks before each layer reduction (one extra
    allgather per call: for debugging). Returns the previous setting."""
    global _check_consistency
    old, _check_consistency = _check_consistency, bool(enabled)
    return old


def _check_same_everywhere(x: torch.Tensor, comm: MPI.Comm, what: str) -> None:
    """Raise on every rank of comm when the ranks' tensors differ in dtype or shape."""
    mine = (str(x.dtype), tuple(x.shape))
    with watchdog.recorded(f"{what}: consistency check (MPI_Allgather)", comm):
        everyone = comm.allgather(mine)
    if any(other != mine for other in everyone):
        listing = ", ".join(f"rank {r}: {d} {list(s)}" for r, (d, s) in enumerate(everyone))
        raise ValueError(f"fastreduce: {what}: the ranks of the communicator passed tensors "
                         f"of different dtype or shape ({listing}); every rank must pass the "
                         f"same")

def zero_volume_tensor(b=None, dtype=None, device=None, requires_grad=False) -> torch.Tensor:
    """An empty tensor for inactive workers: shape (0,), or (b, 0) with a batch size b."""
    shape = (0,) if b is None else (b, 0)
    return torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def _contiguous_allreduce(x: torch.Tensor, op, comm) -> torch.Tensor:
    """Out-of-place core all-reduce that makes x contiguous first instead of refusing it."""
    if _DETACH and x.requires_grad:
        x = x.detach()
    try:
        return allreduce(x, op, comm=comm)
    except BufferError:
        if x.is_contiguous():
            raise
        return allreduce(x.contiguous(), op, comm=comm)


class AllSumReduceFunction(torch.autograd.Function):
    """y = sum of x over comm; its adjoint (backward) is the same sum of the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _contiguous_allreduce(x, "sum", comm)

    @staticmethod
    def backward(ctx, grad):
        return _contiguous_allreduce(grad, "sum", ctx.comm), None


class AllReduceFunction(torch.autograd.Function):
    """Forward all-reduce over comm; backward identity or the same all-reduce."""

    @staticmethod
    def forward(ctx, x, comm, op, reduce_grad):
        ctx.comm, ctx.op, ctx.reduce_grad = comm, op, reduce_grad
        return _contiguous_allreduce(x, op, comm)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            grad = _contiguous_allreduce(grad, ctx.op, ctx.comm)
        return grad, None, None, None


# True only while dynamo traces (torch.compile): the layers then call fastreduce's custom
# ops (fastreduce.ops), which it can put in a graph; eager calls skip them (and the cost of
# torch's dispatcher). One call costs about 0.03 us. Never with torch older than 2.12
# (ops.TRACEABLE): dynamo breaks the graph at the eager path instead.
_compiling = torch.compiler.is_dynamo_compiling if TRACEABLE else (lambda: False)


def _needs_grad(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def sum_over(x: torch.Tensor, comm: MPI.Comm, active: bool, identity: bool,
             what: str) -> torch.Tensor:
    """The all-sum-reduce of x over comm (a cached sub-communicator).

    `identity`: comm has one worker, so the sum is x itself (returned as a clone).
    """
    if _compiling():  # the custom op dynamo traces (its autograd formula is the same)
        if _check_consistency and active and not identity:
            _check_same_everywhere(x, comm, what)  # an MPI call: a graph break
        number = comm_id(comm) if active and not identity else -1
        return _sum_by_number(x, number, active, identity, what)
    if (active and not identity and not (x.requires_grad and torch.is_grad_enabled())
            and not _check_consistency and x.is_contiguous()):
        return allreduce(x, "sum", comm=comm)  # the steady state without autograd
    if not active or identity:
        return _sum_by_number(x, -1, active, identity, what)  # no MPI call: a clone
    if _check_consistency:
        _check_same_everywhere(x, comm, what)
    if _needs_grad(x):
        return AllSumReduceFunction.apply(x, comm)
    return _contiguous_allreduce(x, "sum", comm)


def all_sum_reduce(x: torch.Tensor, P: Partition, axes) -> torch.Tensor:
    """Sum x over the workers of P that share every coordinate outside `axes`; differentiable.

    Not in place: x is untouched, and an identity reduction returns a clone.
    """
    key = tuple(axes)
    if _compiling():
        # id(P) makes dynamo guard on this partition; the set-up (MPI calls) runs once,
        # while tracing, and the graph keeps its answer
        number, active, identity = _sum_plan_constant(id(P), P, key)
        return _sum_by_number(x, number, active, identity, "all_sum_reduce")
    found = _reducers.get((id(P), key))
    if found is not None and found[0] is P:
        _, comm, identity = found
    else:
        comm, identity = _sum_plan(P, key)
    return sum_over(x, comm, P.active, identity, "all_sum_reduce")


def _sum_plan(P: Partition, key: tuple) -> tuple:
    """(communicator, identity) of all_sum_reduce over P's axes `key` (cached)."""
    if not isinstance(P, CartesianPartition):
        if not isinstance(P, Partition):
            raise TypeError(f"fastreduce: P must be a fastreduce Partition, not "
                            f"{type(P).__qualname__}")
        if key not in ((), (0,)):
            raise ValueError(f"fastreduce: axes {key} need a CartesianPartition; "
                             f"a plain Partition has the one axis 0")
        return P.comm, not key or P.size == 1
    comm = P.sub(P.normalize_axes(key))
    identity = not P.active or comm.Get_size() == 1
    if len(_reducers) > 4096:  # partitions come and go in long runs: keep this bounded
        _reducers.clear()
    _reducers[(id(P), key)] = (P, comm, identity)
    return comm, identity


@torch.compiler.assume_constant_result
def _sum_plan_constant(_identity: int, P: Partition, key: tuple) -> tuple:
    """_sum_plan's answer as numbers a graph can hold: (comm number, active, identity)."""
    comm, identity = _sum_plan(P, key)
    return (-1 if identity else comm_id(comm)), bool(P.active), bool(identity)


def _sum_by_number(x: torch.Tensor, number: int, active: bool, identity: bool,
                   what: str) -> torch.Tensor:
    """sum_over by communicator number: a clone on inactive workers (x must be zero-volume)
    and for identity reductions, else the custom op (what dynamo traces)."""
    if not active:
        if x.numel() != 0:
            raise ValueError(f"fastreduce: {what}: this worker is not in the partition, so x "
                             f"must be a zero-volume tensor (fastreduce.zero_volume_tensor()), "
                             f"not shape {list(x.shape)}")
        return x.clone()
    if identity:
        return x.clone()
    return torch.ops.fastreduce.all_sum_reduce(x, number)


# (id(partition), axes as given) -> (partition, sub-communicator, identity): the
# functional form's look-up, so a steady-state call does no axis normalisation.
_reducers: dict = {}


_BACKWARDS = ("identity", "sum")
_OPS = ("sum", "avg")


def check_all_reduce_args(op: str, backward: str) -> None:
    if op not in _OPS:
        raise ValueError(f"fastreduce: AllReduce op must be one of {_OPS}, not {op!r}")
    if backward not in _BACKWARDS:
        raise ValueError(f"fastreduce: backward must be 'identity' or 'sum', not {backward!r}")


def all_reduce(x: torch.Tensor, comm: MPI.Comm | None = None, op: str = "sum",
               backward: str = "identity") -> torch.Tensor:
    """Tensor-parallel all-reduce: forward reduces over comm (out of place).

    backward="identity": the gradient passes unchanged (Megatron's "g");
    backward="sum": the gradient is all-reduced with the same op (the adjoint).
    A group of one worker returns x itself both ways.
    """
    check_all_reduce_args(op, backward)
    if _compiling():
        number, size = comm_constant(id(comm), comm)
        if size == 1:
            return x
        return torch.ops.fastreduce.all_reduce(x, op, number, backward == "sum")
    comm = default_comm() if comm is None else comm
    if comm.Get_size() == 1:
        return x
    return reduce_tensor_parallel(x, comm, op, backward == "sum")


def reduce_tensor_parallel(x: torch.Tensor, comm: MPI.Comm, op: str,
                           reduce_grad: bool) -> torch.Tensor:
    """The forward of AllReduce over a group of more than one worker."""
    if _check_consistency:
        _check_same_everywhere(x, comm, "AllReduce")
    if _compiling():
        return torch.ops.fastreduce.all_reduce(x, op, comm_id(comm), reduce_grad)
    if _needs_grad(x):
        return AllReduceFunction.apply(x, comm, op, reduce_grad)
    return _contiguous_allreduce(x, op, comm)
