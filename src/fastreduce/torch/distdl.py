"""DistDL's names and signatures over fastreduce's partitions and layers.

A DistDL code switches to fastreduce by changing its imports:

    from distdl.backends.mpi.partition import MPIPartition
    from distdl.nn.all_sum_reduce import AllSumReduce
    from distdl.utilities.torch import zero_volume_tensor

become

    from fastreduce.distdl import AllSumReduce, MPIPartition, zero_volume_tensor

The classes here keep DistDL's conventions (an inactive partition has rank
MPI.PROC_NULL and size -1, `shape` and `index` are numpy arrays,
`MPIPartition()` is an inactive placeholder) and hand the work to fastreduce's
own `Partition`, `CartesianPartition` and `nn.AllSumReduce` (`.native`), so
sub-communicators are cached and freed as fastreduce does it.

Where fastreduce is stricter it stays so: an inactive worker must pass a
zero-volume tensor to AllSumReduce, a communicator you pass in stays yours
(deactivate() frees only the communicators a partition made), axes are
checked before any MPI call, and set-up calls are collective over the whole
partition (create_partition_inclusive too: every worker calls it, with the same
ranks, as DistDL's own tests and examples do).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from ..partition import CartesianPartition, Partition
from . import nn as _nn
from .autograd import zero_volume_tensor as _zero_volume_tensor

__all__ = ["AllSumReduce", "MPICartesianPartition", "MPIPartition", "zero_volume_tensor"]


def zero_volume_tensor(b=None, dtype=None, requires_grad=False, device=None) -> torch.Tensor:
    """DistDL's argument order (requires_grad before device) of fastreduce.zero_volume_tensor:
    shape (0,), or (b, 0) with a batch size b."""
    return _zero_volume_tensor(b, dtype=dtype, device=device, requires_grad=requires_grad)


def _default_device(device):
    return torch.device("cpu") if device is None else device


class MPIPartition:
    """DistDL's unstructured partition over a fastreduce `Partition`.

    `MPIPartition()` (no communicator) is an inactive placeholder, as in DistDL;
    `MPIPartition(MPI.COMM_WORLD)` is every rank. `group` and `root` are accepted
    for DistDL's signature and not used (the group is the communicator's).
    """

    def __init__(self, comm=MPI.COMM_NULL, group=MPI.GROUP_NULL, root=None, device=None):
        self._set_native(Partition(comm))
        self.device = _default_device(device)

    @classmethod
    def _wrap(cls, native, device):
        self = cls.__new__(cls)
        self.device = device
        self._set_native(native)
        return self

    def _set_native(self, native) -> None:
        self.native = native  # the fastreduce Partition doing the work
        self.active = native.active
        self.rank = native.rank if self.active else MPI.PROC_NULL
        self.size = native.size if self.active else -1
        self.index = self.rank if self.active else None
        self.shape = np.array([self.size], dtype=int)
        self.dim = 1

    @property
    def comm(self) -> MPI.Intracomm:
        """The partition's communicator (MPI.COMM_NULL on inactive workers)."""
        return self.native.comm

    @property
    def _comm(self) -> MPI.Intracomm:
        """DistDL's spelling of comm (its examples call P._comm.Barrier())."""
        return self.native.comm

    def deactivate(self) -> None:
        """Free the communicator this partition made, with its cached sub-communicators, and
        make the partition inactive. A communicator passed to MPIPartition(comm) is not freed."""
        self.native.deactivate()
        self._set_native(self.native)

    def __eq__(self, other):
        if not isinstance(other, MPIPartition):
            return NotImplemented
        if not (self.active and other.active):
            return False  # DistDL: an inactive partition equals nothing, itself included
        return (MPI.Comm.Compare(self.comm, other.comm) == MPI.IDENT
                and self.rank == other.rank)

    def __hash__(self) -> int:
        return hash((self.comm.py2f(), self.rank)) if self.active else id(self)

    def __repr__(self) -> str:
        state = f"rank {self.rank} of {self.size}" if self.active else "inactive"
        return f"{type(self).__name__}({state})"

    def create_partition_inclusive(self, ranks: Iterable) -> MPIPartition:
        """The given ranks of this partition, in that order; inactive on the others.
        Collective over this partition (every worker passes the same ranks)."""
        return MPIPartition._wrap(self.native.create_partition_inclusive(ranks), self.device)

    def create_cartesian_topology_partition(self, shape: Sequence[int], periods=None,
                                            reorder: bool = False) -> MPICartesianPartition:
        """A Cartesian partition of `shape` over this one's first prod(shape) workers.

        `periods` and `reorder` are MPI_Cart_create's options. Ranks are never reordered:
        reorder=True allows the MPI to reorder, it does not require it, and keeping
        the order keeps every rank's coordinates the same on every MPI.
        """
        del reorder  # allowed to reorder, never needed
        native = self.native.create_cartesian_topology_partition(
            [int(n) for n in np.asarray(shape).ravel()], periods=periods)
        return MPICartesianPartition._wrap(native, self.device)


class MPICartesianPartition(MPIPartition):
    """DistDL's Cartesian partition over a fastreduce `CartesianPartition`.

    `shape` and `index` are numpy arrays (DistDL's); the native partition keeps
    them as tuples (`.native.shape`, `.native.coords`).
    """

    def __init__(self, comm, group=MPI.GROUP_NULL, root=None, shape=None, device=None):
        if shape is None:
            if comm == MPI.COMM_NULL:
                raise ValueError("fastreduce: an inactive MPICartesianPartition needs its shape")
            shape = comm.Get_topo()[0]
        native = CartesianPartition(comm, [int(n) for n in np.asarray(shape).ravel()])
        self._set_native(native)
        self.device = _default_device(device)

    def _set_native(self, native) -> None:
        super()._set_native(native)
        self.shape = np.array(native.shape, dtype=int)  # kept when inactive, as in DistDL
        self.dim = len(self.shape)
        self.index = np.array(native.coords, dtype=int) if self.active else None

    def _check_active(self, what: str) -> None:
        if not self.active:
            raise ValueError(f"fastreduce: {what} needs an active partition; this worker is "
                             f"not in it")

    def cartesian_index(self, rank: int) -> np.ndarray:
        """The Cartesian coordinates of `rank` in this partition."""
        self._check_active("cartesian_index")
        if not 0 <= rank < self.size:
            raise ValueError(f"fastreduce: rank {rank} is not in this partition of "
                             f"{self.size} workers")
        return np.array(self.comm.Get_coords(rank), dtype=int)

    def neighbor_ranks(self, rank: int) -> list[tuple[int, int]]:
        """(left, right) neighbour ranks of `rank` along each axis; MPI.PROC_NULL past an
        edge of a non-periodic axis (a periodic axis wraps around, as MPI_Cart_shift does)."""
        index = self.cartesian_index(rank)
        periods = self.comm.Get_topo()[1]
        out = []
        for axis in range(self.dim):
            pair = []
            for step in (-1, 1):
                where = index.copy()
                where[axis] += step
                if not 0 <= where[axis] < self.shape[axis]:
                    if not periods[axis]:
                        pair.append(MPI.PROC_NULL)
                        continue
                    where[axis] %= self.shape[axis]
                pair.append(self.comm.Get_cart_rank([int(c) for c in where]))
            out.append(tuple(pair))
        return out

    def create_cartesian_subtopology_partition(self, remain_dims) -> MPICartesianPartition:
        """The workers that share this one's coordinates on the axes not kept (MPI_Cart_sub).
        The communicator is fastreduce's cached one: freed with this partition's."""
        native = self.native.create_cartesian_subtopology_partition(
            [bool(r) for r in np.asarray(remain_dims).ravel()])
        if native is self.native:  # every axis kept: a view, so deactivating it frees nothing
            view = CartesianPartition(self.native.comm, self.native.shape)
            view._parent = self.native
            native = view
        return MPICartesianPartition._wrap(native, self.device)

    def create_allreduction_partition(self, axes_reduce) -> MPICartesianPartition:
        """DistDL's all-reduction partition: the workers that share this one's coordinates
        outside `axes_reduce`, as a partition of this one's dimension whose shape is
        this one's on `axes_reduce` and 1 elsewhere. A new communicator (freed by its
        deactivate()); inactive, of that shape, on workers not in this partition."""
        axes = self.native.normalize_axes(axes_reduce, "axes_reduce")
        shape = [n if axis in axes else 1 for axis, n in enumerate(self.native.shape)]
        if not self.active:
            return MPICartesianPartition(MPI.COMM_NULL, shape=shape, device=self.device)
        group = Partition(self.native.sub(axes))  # the cached sub-communicator
        return MPICartesianPartition._wrap(group.create_cartesian_topology_partition(shape),
                                           self.device)


class AllSumReduce(_nn.AllSumReduce):
    """DistDL's AllSumReduce layer: fastreduce's `nn.AllSumReduce` with DistDL's attributes.

    P_x: the MPICartesianPartition of the input and output; give one of
    axes_reduce and axes_keep (partition axes). Attributes: P_x, axes_reduce and
    axes_keep (sorted tuples), identity (True where the sum moves no data: this
    worker's reduction group has one worker). forward(x) sums x over the workers
    that share this worker's coordinates on axes_keep; backward sums the
    gradient the same way (the layer is self-adjoint).
    """

    def __init__(self, P_x, axes_reduce=None, axes_keep=None):
        native = P_x.native if isinstance(P_x, MPIPartition) else P_x
        super().__init__(native, axes_reduce=axes_reduce, axes_keep=axes_keep)
        self.P_x = P_x
        self.axes_keep = tuple(a for a in range(native.dim) if a not in self.axes_reduce)
        self.identity = bool(native.active and self.comm.Get_size() == 1)
