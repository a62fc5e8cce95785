"""Partitions: properties, the sub-communicator cache and its lifetime, bad input."""

from __future__ import annotations

import numpy as np
from common import WORLD, Failures
from mpi4py import MPI

import fastreduce

fails = Failures()
p, rank = WORLD.size, WORLD.rank


expect = fails.expect

world = fastreduce.Partition()
fails.check(world.active and world.size == p and world.rank == rank, "world partition")
fails.check(MPI.Comm.Compare(world.comm, WORLD) == MPI.CONGRUENT, "world comm")

# a 2-d grid over every rank: p = rows x cols
rows = 2 if p % 2 == 0 else 1
cols = p // rows
P = world.create_cartesian_topology_partition([rows, cols])
fails.check(P.shape == (rows, cols) and P.dim == 2 and P.size == p, f"shape {P.shape}")
fails.check(P.coords == (P.rank // cols, P.rank % cols) and P.index == P.coords,
            f"coords {P.coords}")
row_comm = P.sub([1])
fails.check(row_comm is P.sub((1,)) and row_comm is P.sub([-1]), "sub() not cached")
fails.check(row_comm.Get_size() == cols, "row communicator size")
fails.check(P.sub([0, 1]) is P.comm, "sub over every axis is the partition itself")
# the cache is shared by every partition over the same communicator
Q = fastreduce.CartesianPartition(P.comm, P.shape)
fails.check(Q.sub([1]) is row_comm, "cache not shared across partitions of one comm")
row_p = P.create_cartesian_subtopology_partition([False, True])
fails.check(row_p.comm is row_comm and row_p.shape == (cols,), "subtopology partition")
fails.check(P.create_cartesian_subtopology_partition([True, True]) is P, "keep-all subtopology")
got = fastreduce.allreduce(np.array([float(rank)]), comm=row_comm)[0]
fails.check(got == sum(r for r in range(p) if r // cols == P.rank // cols), "row sum")

# freeing the parent frees its cached subs (the attribute's delete callback)
parent = WORLD.Dup()
T = fastreduce.Partition(parent).create_cartesian_topology_partition([p])
sub = T.sub([0])
fails.check(sub is T.comm, "1-d sub over its only axis")
T2 = fastreduce.Partition(parent).create_cartesian_topology_partition([1, p])
sub2 = T2.sub([1])
T2.comm.Free()
fails.check(sub2 == MPI.COMM_NULL, "a cached sub survived its parent's Free()")
parent.Free()

# inclusive partitions: the first half of the ranks; the others are inactive
half = world.create_partition_inclusive(range((p + 1) // 2))
if rank < (p + 1) // 2:
    fails.check(half.active and half.size == (p + 1) // 2 and half.rank == rank, "inclusive")
else:
    fails.check(not half.active and half.comm == MPI.COMM_NULL and half.size == 0, "excluded")
    C = half.create_cartesian_topology_partition([1])
    fails.check(not C.active and C.sub([0]) == MPI.COMM_NULL and C.coords is None, "inactive")

# a shape smaller than the partition leaves the extra workers inactive
small = world.create_cartesian_topology_partition([max(1, p - 1)])
fails.check(small.active == (rank < max(1, p - 1)), "extra workers inactive")

# bad input: a clear exception before any MPI call
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
fails.finish()
