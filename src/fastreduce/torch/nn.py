"""torch.nn modules over fastreduce's differentiable all-reduces."""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..backend.collectives import default_comm
from ..partition import CartesianPartition
from .autograd import check_all_reduce_args, reduce_tensor_parallel, sum_over
from .custom_ops import comm_id

__all__ = ["AllReduce", "AllSumReduce"]


class AllSumReduce(torch.nn.Module):
    """Sum over the workers of P along `axes_reduce` (or all axes but `axes_keep`).

    Every worker gets the sum of the x of the workers that share its coordinates
    on the kept axes. Self-adjoint: backward sums the gradient the same way. The
    sub-communicator is taken from P's cache at construction, so building many
    layers over the same partition and axes creates one communicator in all.
    """

    def __init__(self, P: CartesianPartition, axes_reduce=None, axes_keep=None):
        super().__init__()
        if not isinstance(P, CartesianPartition):
            raise TypeError(f"fastreduce: AllSumReduce needs a CartesianPartition, not "
                            f"{type(P).__qualname__}")
        if (axes_reduce is None) == (axes_keep is None):
            raise ValueError("fastreduce: give exactly one of axes_reduce and axes_keep")
        if axes_reduce is not None:
            axes = P.normalize_axes(axes_reduce, "axes_reduce")
        else:
            keep = P.normalize_axes(axes_keep, "axes_keep")
            axes = tuple(a for a in range(P.dim) if a not in keep)
        self.P = P
        self.axes_reduce = axes
        self.comm = P.sub(axes)
        self._identity = not P.active or self.comm.Get_size() == 1
        if not self._identity:
            comm_id(self.comm)  # named for torch.compile's custom op now, not while tracing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum_over(x, self.comm, self.P.active, self._identity, "AllSumReduce")

    def extra_repr(self) -> str:
        return f"axes_reduce={self.axes_reduce}, partition shape={list(self.P.shape)}"


class AllReduce(torch.nn.Module):
    """Tensor-parallel all-reduce over comm; backward is the identity or the same all-reduce."""

    def __init__(self, comm: MPI.Comm | None = None, op: str = "sum",
                 backward: str = "identity"):
        super().__init__()
        check_all_reduce_args(op, backward)
        self.comm = default_comm() if comm is None else comm
        self.op = op
        self.backward_mode = backward
        self.size = self.comm.Get_size()
        if self.size > 1:
            comm_id(self.comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return reduce_tensor_parallel(x, self.comm, self.op, self.backward_mode == "sum")

    def extra_repr(self) -> str:
        return f"op={self.op!r}, backward={self.backward_mode!r}, size={self.size}"
