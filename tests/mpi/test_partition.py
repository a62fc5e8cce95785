"""Partitions: properties, the sub-communicator cache and its lifetime, bad input; and the
seed example at 13 ranks (12 workers and one inactive rank)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import fastreduce

pytestmark = pytest.mark.mpi(ranks=(1, 2, 3, 4))

WORLD = MPI.COMM_WORLD
p, rank = WORLD.size, WORLD.rank
rows = 2 if p % 2 == 0 else 1
cols = p // rows


@pytest.fixture(scope="module")
def world():
    """The partition of every rank."""
    return fastreduce.Partition()


@pytest.fixture(scope="module")
def P(world):
    """A 2-d grid over every rank: p = rows x cols."""
    return world.create_cartesian_topology_partition([rows, cols])


@pytest.mark.across_nodes
@pytest.mark.minimum_versions
def test_world_partition(checks, world):
    checks.check(world.active and world.size == p and world.rank == rank, "world partition")
    checks.check(MPI.Comm.Compare(world.comm, WORLD) == MPI.CONGRUENT, "world comm")


@pytest.mark.across_nodes
@pytest.mark.minimum_versions
def test_cartesian_grid_and_its_sub_communicators(checks, world, P):
    """Shape and coordinates; sub() cached, and shared by every partition over the same
    communicator; subtopology partitions over the cached sub-communicators."""
    checks.check(P.shape == (rows, cols) and P.dim == 2 and P.size == p, f"shape {P.shape}")
    checks.check(P.coords == (P.rank // cols, P.rank % cols) and P.index == P.coords,
                 f"coords {P.coords}")
    row_comm = P.sub([1])
    checks.check(row_comm is P.sub((1,)) and row_comm is P.sub([-1]), "sub() not cached")
    checks.check(row_comm.Get_size() == cols, "row communicator size")
    checks.check(P.sub([0, 1]) is P.comm, "sub over every axis is the partition itself")
    # the cache is shared by every partition over the same communicator
    Q = fastreduce.CartesianPartition(P.comm, P.shape)
    checks.check(Q.sub([1]) is row_comm, "cache not shared across partitions of one comm")
    row_p = P.create_cartesian_subtopology_partition([False, True])
    checks.check(row_p.comm is row_comm and row_p.shape == (cols,), "subtopology partition")
    checks.check(P.create_cartesian_subtopology_partition([True, True]) is P,
                 "keep-all subtopology")
    got = fastreduce.allreduce(np.array([float(rank)]), comm=row_comm)[0]
    checks.check(got == sum(r for r in range(p) if r // cols == P.rank // cols), "row sum")


@pytest.mark.across_nodes
@pytest.mark.minimum_versions
def test_freeing_the_parent_frees_its_cached_subs(checks):
    """Freeing the parent frees its cached subs (the attribute's delete callback)."""
    parent = WORLD.Dup()
    T = fastreduce.Partition(parent).create_cartesian_topology_partition([p])
    sub = T.sub([0])
    checks.check(sub is T.comm, "1-d sub over its only axis")
    T2 = fastreduce.Partition(parent).create_cartesian_topology_partition([1, p])
    sub2 = T2.sub([1])
    T2.comm.Free()
    checks.check(sub2 == MPI.COMM_NULL, "a cached sub survived its parent's Free()")
    parent.Free()


@pytest.mark.across_nodes
def test_freeing_communicators_whatever_the_mpis_attribute_pool_holds(checks):
    """MPI_Comm_free runs the delete callbacks of the communicator's attributes: the sub
    cache of a Cartesian partition, the progress engine's duplicate. Callbacks that asked
    MPI about the communicator being freed (mpi4py's make an mpi4py object of it:
    MPI_Topo_test) made MPICH walk an attribute list whose attributes set later (at the
    communicator's first collectives) it had freed already: a segmentation fault whenever
    MPICH's pool of attribute objects was full at that moment. One more attribute
    is held each round, so each loop meets a full pool once whatever the session left in
    it (MPICH allocates them in blocks of 1024, after a few dozen). Local: COMM_SELF."""
    from fastreduce.backend.collectives import engine_comm
    from fastreduce.backend.engine import wait_idle

    holder = MPI.COMM_SELF.Dup()
    keyvals = []
    freed = 0
    try:
        for n in range(1100):
            T = fastreduce.Partition(MPI.COMM_SELF).create_cartesian_topology_partition([1])
            sub = T.sub([])  # MPI_Cart_sub, cached in the partition communicator's attribute
            T.deactivate()  # MPI_Comm_free: the cache's callback frees sub
            freed += sub == MPI.COMM_NULL
            keyvals.append(MPI.Comm.Create_keyval())
            holder.Set_attr(keyvals[-1], n)
        for n in range(1100):  # the progress engine's duplicate, freed with its communicator
            cart = MPI.COMM_SELF.Create_cart([1])
            dup = engine_comm(cart)
            fastreduce.allreduce_(np.zeros(1), comm=cart)  # its plan: an attribute set later
            cart.Free()  # the callback queues the duplicate's MPI_Comm_free on the engine
            wait_idle()
            freed += dup == MPI.COMM_NULL
            keyvals.append(MPI.Comm.Create_keyval())
            holder.Set_attr(keyvals[-1], n)
    finally:
        holder.Free()
        for keyval in keyvals:
            MPI.Comm.Free_keyval(keyval)
    checks.check(freed == 2200, f"{2200 - freed} of 2200 cached subs and duplicates outlived "
                 f"their communicator")


@pytest.mark.mpi(ranks=2)
def test_the_collector_frees_no_communicator(checks):
    """A partition the garbage collector takes frees its communicator at the next partition
    made, never in the collector's pass: that pass runs at any allocation, also inside an
    mpi4py call holding mpi4py's lock table (a communicator's first comm.allgather), where
    freeing a communicator waits for that lock forever (a 2-rank MPICH job hung so)."""
    import gc

    partition = fastreduce.Partition().create_partition_inclusive(range(p))
    owned = partition.comm
    partition.cycle = partition  # the collector's to take, not the reference count's
    del partition
    gc.collect()
    checks.check(owned != MPI.COMM_NULL, "the collector's pass freed the communicator")
    fastreduce.Partition().create_partition_inclusive(range(p)).deactivate()
    checks.check(owned == MPI.COMM_NULL, "not freed at the next partition made")


@pytest.mark.across_nodes
@pytest.mark.minimum_versions
def test_inclusive_partition(checks, world):
    """The first half of the ranks; the others are inactive."""
    half = world.create_partition_inclusive(range((p + 1) // 2))
    if rank < (p + 1) // 2:
        checks.check(half.active and half.size == (p + 1) // 2 and half.rank == rank,
                     "inclusive")
    else:
        checks.check(not half.active and half.comm == MPI.COMM_NULL and half.size == 0,
                     "excluded")
        C = half.create_cartesian_topology_partition([1])
        checks.check(not C.active and C.sub([0]) == MPI.COMM_NULL and C.coords is None,
                     "inactive")


@pytest.mark.across_nodes
@pytest.mark.minimum_versions
def test_extra_workers_inactive(checks, world):
    """A shape smaller than the partition leaves the extra workers inactive."""
    small = world.create_cartesian_topology_partition([max(1, p - 1)])
    checks.check(small.active == (rank < max(1, p - 1)), "extra workers inactive")


@pytest.mark.across_nodes
@pytest.mark.minimum_versions
def test_bad_input(checks, world, P):
    """Bad input: a clear exception before any MPI call."""
    expect = checks.expect
    expect(ValueError, ["needs", str(p + 1), f"has {p}"],
           lambda: world.create_cartesian_topology_partition([p + 1]))
    expect(ValueError, ["positive"], lambda: world.create_cartesian_topology_partition([0, 2]))
    expect(TypeError, ["sequence of integers"],
           lambda: world.create_cartesian_topology_partition(["a"]))
    expect(ValueError, [f"[{p}]", "not in this partition"],
           lambda: world.create_partition_inclusive([0, p]))
    expect(ValueError, ["repeat"], lambda: world.create_partition_inclusive([0, 0]))
    expect(ValueError, ["axes [2]", "out of range"], lambda: P.sub([2]))
    expect(ValueError, ["repeat"], lambda: P.sub([1, -1]))
    expect(ValueError, ["remain_dims"], lambda: P.create_cartesian_subtopology_partition([True]))
    expect(TypeError, ["communicator"], lambda: fastreduce.Partition("world"))


@pytest.mark.one_mpi
@pytest.mark.mpi(ranks=(13,))  # one rank is inactive
def test_seed_example(checks):
    """The seed example, as written apart from imports, checked against a reference.

    Each worker's x is seeded by its rank in P_x; every rank rebuilds the inputs of
    the 6 workers that share its first coordinate and sums them with numpy.
    """
    P_world = fastreduce.Partition()
    P_x_base = P_world.create_partition_inclusive(np.arange(0, 12))
    P_x = P_x_base.create_cartesian_topology_partition([2, 2, 3])
    layer = fastreduce.nn.AllSumReduce(P_x, axes_reduce=(1, 2))
    x = fastreduce.zero_volume_tensor()
    if P_x.active:
        torch.manual_seed(1000 + P_x.rank)
        x = torch.rand(3, 7, 5)
    y = layer(x)  # each y is the sum of the x of the 6 workers that share its first coordinate

    if P_x.active:
        first = P_x.coords[0]
        partners = [r for r in range(12) if np.unravel_index(r, (2, 2, 3))[0] == first]
        inputs = []
        for r in partners:
            torch.manual_seed(1000 + r)
            inputs.append(torch.rand(3, 7, 5).double().numpy())
        want = np.sum(inputs, axis=0)
        checks.check(len(partners) == 6, f"partners {partners}")
        checks.check(y.shape == x.shape and y.dtype == x.dtype, f"y {y.shape} {y.dtype}")
        err = float(np.max(np.abs(y.double().numpy() - want)))
        checks.check(err <= 6 * 2**-24 * 6, f"y differs from the reference sum by {err}")
        checks.check(P_x.shape == (2, 2, 3) and P_x.size == 12, f"{P_x.shape} {P_x.size}")
        checks.check(list(P_x.coords) == list(np.unravel_index(P_x.rank, (2, 2, 3))),
                     f"coords {P_x.coords} of rank {P_x.rank}")
    else:
        checks.check(WORLD.rank >= 12, f"rank {WORLD.rank} inactive")
        checks.check(y.numel() == 0 and y is not x, "inactive worker's result is a clone")
        checks.check(P_x.comm == MPI.COMM_NULL and not P_x.active, "inactive partition")
