"""Set-up calls that ranks make differently raise on every rank (never a crash or a hang),
and inactive workers of a sub-partition see an inactive partition of the sub's shape."""

from __future__ import annotations

import torch
from common import WORLD, Failures
from mpi4py import MPI

import fastreduce
from fastreduce.nn import AllSumReduce

f = Failures()
p, rank = WORLD.size, WORLD.rank


def check_inactive_subpartitions():
    """Inactive workers get an inactive partition shaped like the sub-partition."""
    active_n = max(1, p - 1)  # one worker (the last) left out when p > 1
    P = fastreduce.Partition().create_cartesian_topology_partition([active_n, 1])
    for remain, shape in (([True, False], (active_n,)), ([False, True], (1,)),
                          ([True, True], (active_n, 1))):
        Q = P.create_cartesian_subtopology_partition(remain)
        f.check(Q.shape == shape and Q.dim == len(shape),
                f"remain {remain}: {'active' if P.active else 'inactive'} worker sees shape "
                f"{Q.shape}, want {shape}")
        f.check(Q.active == P.active, f"remain {remain}: active {Q.active}, parent {P.active}")
        if not P.active:
            f.check(Q.rank == -1 and Q.size == 0 and Q.coords is None,
                    f"inactive sub-partition: rank {Q.rank} size {Q.size}")
    R = fastreduce.Partition().create_partition_inclusive([0])
    f.check(R.active == (rank == 0), "create_partition_inclusive: active only on rank 0")
    S = R.create_cartesian_topology_partition([1])
    f.check(S.active == (rank == 0) and S.shape == (1,), "Cartesian over an inclusive partition")


def check_construction_order():
    """Layers built in a rank-dependent order: every rank raises, then the same order works."""
    rows = 2 if p % 2 == 0 and p > 2 else 1
    P = fastreduce.Partition().create_cartesian_topology_partition([rows, p // rows])
    if rows == 1 or p // rows == 1:
        return  # one of the subs would be the partition itself or a single worker

    def build():
        axes = ([0], [1]) if rank % 2 == 0 else ([1], [0])
        return [AllSumReduce(P, axes_reduce=a) for a in axes]

    f.expect_everywhere(build, ["axes", "MPI_Cart_sub", "ranks"])
    layers = [AllSumReduce(P, axes_reduce=[0]), AllSumReduce(P, axes_reduce=[1])]
    x = torch.full((3,), float(rank))
    got = layers[0](x)
    col = [r for r in range(p) if r % (p // rows) == rank % (p // rows)]
    f.check(torch.equal(got, torch.full((3,), float(sum(col)))), f"sum after recovery {got}")


def check_setup_arguments():
    if p == 1:
        return
    shape = [p] if rank != 1 else [1, p]
    f.expect_everywhere(lambda: fastreduce.Partition().create_cartesian_topology_partition(shape),
                      ["shape", "rank 1"])
    ranks = [0] if rank != 0 else [0, p + 5]
    f.expect_everywhere(lambda: fastreduce.Partition().create_partition_inclusive(ranks),
                      ["refused", "rank 0"], own_error=ValueError)
    big = [p + 1] if rank == p - 1 else [p]
    f.expect_everywhere(lambda: fastreduce.Partition().create_cartesian_topology_partition(big),
                      ["refused"], own_error=ValueError)
    # still usable afterwards
    P = fastreduce.Partition().create_cartesian_topology_partition([p])
    f.check(P.active and P.shape == (p,), "partition after the refused calls")


def check_lifetimes():
    """A sub-partition, a layer or a torch group keeps the partition it came from (and so
    its communicators) alive; a dropped partition frees them; deactivate() frees at once."""
    import gc

    def sub_only():
        P = fastreduce.Partition().create_cartesian_topology_partition([p, 1])
        return P.create_cartesian_subtopology_partition([True, False])

    def layer_only():
        P = fastreduce.Partition().create_cartesian_topology_partition([p, 1])
        return AllSumReduce(P, axes_reduce=[0])

    Q, layer = sub_only(), layer_only()
    gc.collect()
    x = torch.full((2,), float(rank))
    f.check(torch.equal(fastreduce.allreduce(x, comm=Q.comm), torch.full((2,), float(sum(
        range(p))))), "a sub-partition whose parent was dropped")
    f.check(torch.equal(layer(x), torch.full((2,), float(sum(range(p))))),
            "a layer whose partition was dropped")
    P = fastreduce.Partition().create_cartesian_topology_partition([p])
    comm = P.comm
    P.deactivate()
    f.check(not P.active and P.comm == MPI.COMM_NULL, "deactivate() leaves it inactive")
    f.check(comm == MPI.COMM_NULL, "deactivate() did not free the communicator")


f.run("lifetimes", check_lifetimes)
f.run("inactive sub-partitions", check_inactive_subpartitions)
f.run("construction order", check_construction_order)
f.run("set-up arguments", check_setup_arguments)
f.finish()
