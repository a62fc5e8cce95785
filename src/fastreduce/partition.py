"""Partitions of workers (DistDL's model) with cached Cartesian sub-communicators.

    P_world = Partition()                                   # every rank
    P_base = P_world.create_partition_inclusive(range(12))  # ranks 0..11; others inactive
    P_x = P_base.create_cartesian_topology_partition([2, 2, 3])
    comm = P_x.sub((1, 2))   # the workers that share P_x.coords[0]; made once, then cached

A sub-communicator is created by the first `sub(axes)` for those axes
(MPI_Cart_sub) and kept in an MPI attribute of the parent communicator, so
every partition over that communicator shares it, later calls make no MPI
call, and freeing the parent frees its subs (the attribute's delete
callback, written in C: backend/commattr, not mpi4py's, which asks MPICH about
the communicator it is freeing and can crash there).
"""

from __future__ import annotations

import collections
import math
import operator
import weakref
from collections.abc import Iterable, Sequence

from mpi4py import MPI

from . import watchdog
from .backend import commattr
from .backend.collectives import default_comm
from .checks import agree

__all__ = ["CartesianPartition", "Partition"]

_GROUP_TAG = 0x6672  # tag of MPI_Comm_create_group calls made here
_subs_keyval: int | None = None


def _free_subs(subs: dict) -> None:
    """Delete callback of the sub-communicator cache: the parent is being freed (the cache
    holds sub-communicators only, never the parent itself)."""
    for sub in subs.values():
        if sub != MPI.COMM_NULL and sub != MPI.COMM_SELF:
            sub.Free()
    subs.clear()


def _sub_cache(comm: MPI.Comm) -> dict:
    """The dict of sub-communicators attached to `comm` (created on first use)."""
    global _subs_keyval
    if _subs_keyval is None:
        _subs_keyval = commattr.create_keyval(_free_subs)
    subs = commattr.get_attr(comm, _subs_keyval)
    if subs is None:
        subs = {}
        commattr.set_attr(comm, _subs_keyval, subs)
    return subs


def _free_owned(comm: MPI.Comm) -> None:
    """Free a communicator a partition made (its cached sub-communicators go with it: the
    attribute's delete callback)."""
    if not MPI.Is_finalized() and comm != MPI.COMM_NULL:
        comm.Free()


# Communicators of partitions dropped (by the reference count or the garbage collector),
# freed at the next partition made or deactivated (on ranks that make none, at exit).
# Never at the drop: the collector runs at any allocation, also inside an mpi4py call that
# holds mpi4py's communicator-lock table (comm.allgather's first use on a communicator),
# and freeing a communicator there waits for that lock forever.
_collected: collections.deque[MPI.Comm] = collections.deque()


def _free_collected() -> None:
    """Free the communicators of partitions collected since the last call."""
    while _collected:
        try:
            comm = _collected.popleft()
        except IndexError:  # (another thread took the last)
            return
        _free_owned(comm)


def _owning(partition: Partition, comm: MPI.Comm) -> Partition:
    """The partition owns comm, which it made: freed with deactivate(), or after the
    partition is dropped (at the next partition made), so partitions made and dropped in
    a loop do not exhaust the MPI's communicators (MPICH has about 2048)."""
    partition._owned = weakref.finalize(partition, _collected.append, comm)
    return partition


def _as_int_list(values: Iterable, what: str) -> list[int]:
    try:
        out = [operator.index(v) for v in values]
    except TypeError:
        raise TypeError(f"fastreduce: {what} must be a sequence of integers, got "
                        f"{values!r}") from None
    return out


# Set by fastreduce.torch.distributed when it is imported (the torch layer sits above this
# one): comm -> a torch.distributed process group sharing that communicator.
_process_group_factory = None


def set_process_group_factory(factory) -> None:
    """Install the maker of Partition.process_group()'s groups (the torch backend does)."""
    global _process_group_factory
    _process_group_factory = factory


class Partition:
    """A set of workers over an mpi4py intracommunicator; inactive where comm is COMM_NULL."""

    def __init__(self, comm: MPI.Intracomm | None = None):
        _free_collected()
        if comm is None:
            comm = default_comm()
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"fastreduce: Partition needs an mpi4py communicator or None, not "
                            f"{type(comm).__qualname__}")
        if comm != MPI.COMM_NULL and comm.Is_inter():
            raise ValueError("fastreduce: a Partition needs an intracommunicator")
        self._comm = comm
        self.active = comm != MPI.COMM_NULL
        self.rank = comm.Get_rank() if self.active else -1
        self.size = comm.Get_size() if self.active else 0
        self._process_group = None

    @property
    def comm(self) -> MPI.Intracomm:
        """The mpi4py communicator of this partition, or MPI.COMM_NULL on inactive workers."""
        return self._comm

    def deactivate(self) -> None:
        """Free this partition's communicator (if this partition made it) and its cached
        sub-communicators; the partition becomes inactive. Collective over the partition."""
        owned = getattr(self, "_owned", None)
        if owned is not None and owned.alive:
            owned.detach()
            _free_owned(self._comm)
        _free_collected()
        self._comm = MPI.COMM_NULL
        self.active = False
        self.rank, self.size = -1, 0
        if hasattr(self, "coords"):
            self.coords = None
            self._subs = {}

    def process_group(self):
        """This partition's communicator as a torch.distributed process group of the
        fastreduce backend: made once, by the partition's members, after
        dist.init_process_group("fastreduce"); fastreduce and torch then share it."""
        if not self.active:
            raise ValueError("fastreduce: this worker is not in the partition (inactive); only "
                             "its members call process_group()")
        if self._process_group is None:
            if _process_group_factory is None:
                raise RuntimeError("fastreduce: Partition.process_group() needs the "
                                   "torch.distributed backend: import fastreduce.distributed "
                                   "and call dist.init_process_group('fastreduce') first")
            self._process_group = _process_group_factory(self._comm)
            self._process_group._partition = self  # the group keeps the communicator alive
        return self._process_group

    def __repr__(self) -> str:
        state = f"rank {self.rank} of {self.size}" if self.active else "inactive"
        return f"{type(self).__name__}({state})"

    def create_partition_inclusive(self, ranks: Iterable) -> Partition:
        """A Partition of the given ranks of this one (collective over this partition: every
        worker passes the same ranks); the others get an inactive one."""
        error = None
        try:
            ranks = _as_int_list(ranks, "ranks")
            if not ranks:
                raise ValueError("fastreduce: create_partition_inclusive needs at least one "
                                 "rank")
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"fastreduce: ranks {ranks} repeat a rank")
            outside = [r for r in ranks if not 0 <= r < self.size]
            if outside:
                raise ValueError(f"fastreduce: ranks {outside} are not in this partition of "
                                 f"{self.size} workers (valid: 0..{self.size - 1})")
        except (TypeError, ValueError) as exc:
            error = exc
        if not self.active:
            if error is not None:
                raise error
            return Partition(MPI.COMM_NULL)
        agree(self._comm, "create_partition_inclusive",
              {"ranks": None if error is not None else ranks}, error)
        if self.rank not in ranks:
            return Partition(MPI.COMM_NULL)
        group = self._comm.Get_group()
        try:
            subgroup = group.Incl(ranks)
            try:
                comm = self._comm.Create_group(subgroup, tag=_GROUP_TAG)
            finally:
                subgroup.Free()
        finally:
            group.Free()
        return _owning(Partition(comm), comm)

    def create_cartesian_topology_partition(
        self, shape: Sequence[int], periods: Sequence[bool] | None = None
    ) -> CartesianPartition:
        """A CartesianPartition of `shape` over the first prod(shape) workers (MPI_Cart_create)."""
        shape = _as_int_list(shape, "shape")
        if not shape or any(n < 1 for n in shape):
            raise ValueError(f"fastreduce: shape {shape} must be a non-empty list of positive "
                             f"integers")
        periods = [False] * len(shape) if periods is None else [bool(p) for p in periods]
        if len(periods) != len(shape):
            raise ValueError(f"fastreduce: periods {periods} and shape {shape} differ in length")
        if not self.active:
            return CartesianPartition(MPI.COMM_NULL, shape)
        error = None
        if math.prod(shape) > self.size:
            error = ValueError(f"fastreduce: shape {shape} needs {math.prod(shape)} workers "
                               f"but this partition has {self.size}")
        agree(self._comm, "create_cartesian_topology_partition",
              {"shape": shape, "periods": periods}, error)
        with watchdog.recorded("MPI_Cart_create: a Cartesian partition", self._comm):
            comm = self._comm.Create_cart(shape, periods=periods, reorder=False)
        return _owning(CartesianPartition(comm, shape), comm)


class CartesianPartition(Partition):
    """Workers on a Cartesian grid; sub-communicators along any axes are cached."""

    def __init__(self, comm: MPI.Intracomm, shape: Sequence[int]):
        super().__init__(comm)
        self.shape = tuple(shape)
        self.dim = len(self.shape)
        if self.active:
            if not isinstance(comm, MPI.Cartcomm) or tuple(comm.Get_topo()[0]) != self.shape:
                raise ValueError("fastreduce: a CartesianPartition needs a Cartesian "
                                 f"communicator of shape {list(self.shape)}")
            self.coords = tuple(comm.Get_coords(self.rank))
            self._subs = _sub_cache(comm)
        else:
            self.coords = None
            self._subs = {}

    @property
    def index(self) -> tuple | None:
        """DistDL's name for coords."""
        return self.coords

    def normalize_axes(self, axes: Iterable, what: str = "axes") -> tuple[int, ...]:
        """Sorted axes (negative ones count from the end); ValueError if out of range/repeated."""
        axes = _as_int_list(axes, what)
        normal = [a + self.dim if a < 0 else a for a in axes]
        bad = [a for a, n in zip(axes, normal, strict=True) if not 0 <= n < self.dim]
        if bad:
            raise ValueError(f"fastreduce: {what} {bad} out of range for a {self.dim}-d "
                             f"partition of shape {list(self.shape)}")
        if len(set(normal)) != len(normal):
            raise ValueError(f"fastreduce: {what} {axes} repeat an axis")
        return tuple(sorted(normal))

    def sub(self, axes: Iterable) -> MPI.Intracomm:
        """The communicator of the workers that share every coordinate outside `axes`.

        Made once by MPI_Cart_sub (collective over this partition) and cached with
        this partition's communicator, which frees it: it lives as long as this partition
        (keep the partition, or a layer or sub-partition over it); MPI.COMM_NULL on
        inactive workers.
        """
        key = self.normalize_axes(axes)
        if not self.active:
            return MPI.COMM_NULL
        if len(key) == self.dim:
            return self._comm  # every axis: the partition itself (not in the cache it owns)
        subs = self._subs
        comm = subs.get(key)
        if comm is not None:
            return comm
        # MPI_Cart_sub with different axes on different ranks (e.g. layers built in a
        # rank-dependent order) crashes some MPIs: agree first, raise everywhere
        agree(self._comm, "a sub-communicator (MPI_Cart_sub)", {"axes": list(key)})
        with watchdog.recorded(f"MPI_Cart_sub: axes {list(key)}", self._comm):
            comm = self._comm.Sub([axis in key for axis in range(self.dim)])
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        subs[key] = comm
        return comm

    def create_cartesian_subtopology_partition(
        self, remain_dims: Sequence[bool]
    ) -> CartesianPartition:
        """DistDL's spelling of sub(): a CartesianPartition over the cached sub-communicator."""
        remain = [bool(r) for r in remain_dims]
        if len(remain) != self.dim:
            raise ValueError(f"fastreduce: remain_dims {list(remain_dims)} must have one entry "
                             f"per axis of the shape {list(self.shape)}")
        axes = [axis for axis, keep in enumerate(remain) if keep]
        shape = [self.shape[axis] for axis in axes]
        if not shape:
            raise ValueError("fastreduce: remain_dims keeps no axis")
        if len(axes) == self.dim:  # every axis kept: this partition (active or not)
            return self
        sub = CartesianPartition(self.sub(axes), shape)  # inactive here: COMM_NULL
        sub._parent = self  # its communicator is this partition's: keep it alive
        return sub
