"""Misuse across ranks: set-up calls that ranks make differently raise on every rank (never
a crash or a hang); inactive workers of a sub-partition see an inactive partition of the
sub's shape; partitions, layers and sub-partitions keep what they need alive."""

from __future__ import annotations

import gc

import pytest
import torch
from mpi4py import MPI

import fastreduce
from fastreduce.nn import AllSumReduce

pytestmark = pytest.mark.mpi(ranks=(1, 2, 3, 4))


def test_lifetimes(checks, comm):
    """A sub-partition, a layer or a torch group keeps the partition it came from (and so
    its communicators) alive; a dropped partition frees them; deactivate() frees at once."""
    p, rank = comm.size, comm.rank

    def sub_only():
        P = fastreduce.Partition().create_cartesian_topology_partition([p, 1])
        return P.create_cartesian_subtopology_partition([True, False])

    def layer_only():
        P = fastreduce.Partition().create_cartesian_topology_partition([p, 1])
        return AllSumReduce(P, axes_reduce=[0])

    Q, layer = sub_only(), layer_only()
    gc.collect()
    x = torch.full((2,), float(rank))
    checks.check(torch.equal(fastreduce.allreduce(x, comm=Q.comm), torch.full((2,), float(sum(
        range(p))))), "a sub-partition whose parent was dropped")
    checks.check(torch.equal(layer(x), torch.full((2,), float(sum(range(p))))),
                 "a layer whose partition was dropped")
    P = fastreduce.Partition().create_cartesian_topology_partition([p])
    made = P.comm
    P.deactivate()
    checks.check(not P.active and P.comm == MPI.COMM_NULL, "deactivate() leaves it inactive")
    checks.check(made == MPI.COMM_NULL, "deactivate() did not free the communicator")


@pytest.mark.parametrize("remain, sub_shape", [
    pytest.param([True, False], lambda n: (n,), id="first-axis"),
    pytest.param([False, True], lambda n: (1,), id="second-axis"),
    pytest.param([True, True], lambda n: (n, 1), id="both-axes"),
])
def test_inactive_subpartitions(remain, sub_shape, checks, comm):
    """Inactive workers get an inactive partition shaped like the sub-partition (one
    worker, the last, left out of a [p - 1, 1] partition when p > 1)."""
    p = comm.size
    active_n = max(1, p - 1)
    shape = sub_shape(active_n)
    P = fastreduce.Partition().create_cartesian_topology_partition([active_n, 1])
    Q = P.create_cartesian_subtopology_partition(remain)
    checks.check(Q.shape == shape and Q.dim == len(shape),
                 f"remain {remain}: {'active' if P.active else 'inactive'} worker sees shape "
                 f"{Q.shape}, want {shape}")
    checks.check(Q.active == P.active, f"remain {remain}: active {Q.active}, parent {P.active}")
    if not P.active:
        checks.check(Q.rank == -1 and Q.size == 0 and Q.coords is None,
                     f"inactive sub-partition: rank {Q.rank} size {Q.size}")


def test_inclusive_partition(checks, comm):
    """A partition of rank 0 alone, and a Cartesian partition over it."""
    rank = comm.rank
    R = fastreduce.Partition().create_partition_inclusive([0])
    checks.check(R.active == (rank == 0), "create_partition_inclusive: active only on rank 0")
    S = R.create_cartesian_topology_partition([1])
    checks.check(S.active == (rank == 0) and S.shape == (1,),
                 "Cartesian over an inclusive partition")


def test_construction_order(checks, comm):
    """Layers built in a rank-dependent order: every rank raises, then the same order works."""
    p, rank = comm.size, comm.rank
    rows = 2 if p % 2 == 0 and p > 2 else 1
    if rows == 1 or p // rows == 1:
        pytest.skip("needs an even rank count above 2: with one row or one column a sub "
                    "would be the partition itself or a single worker")
    P = fastreduce.Partition().create_cartesian_topology_partition([rows, p // rows])

    def build():
        axes = ([0], [1]) if rank % 2 == 0 else ([1], [0])
        return [AllSumReduce(P, axes_reduce=a) for a in axes]

    checks.expect_everywhere(build, ["axes", "MPI_Cart_sub", "ranks"])
    layers = [AllSumReduce(P, axes_reduce=[0]), AllSumReduce(P, axes_reduce=[1])]
    x = torch.full((3,), float(rank))
    got = layers[0](x)
    col = [r for r in range(p) if r % (p // rows) == rank % (p // rows)]
    checks.check(torch.equal(got, torch.full((3,), float(sum(col)))),
                 f"sum after recovery {got}")


def _shape_differs(p, rank):
    shape = [p] if rank != 1 else [1, p]
    return lambda: fastreduce.Partition().create_cartesian_topology_partition(shape)


def _rank_out_of_range(p, rank):
    ranks = [0] if rank != 0 else [0, p + 5]
    return lambda: fastreduce.Partition().create_partition_inclusive(ranks)


def _too_many_workers(p, rank):
    big = [p + 1] if rank == p - 1 else [p]
    return lambda: fastreduce.Partition().create_cartesian_topology_partition(big)


@pytest.mark.parametrize("make_call, words, own_error", [
    pytest.param(_shape_differs, ["shape", "rank 1"], None, id="cartesian-shape"),
    pytest.param(_rank_out_of_range, ["refused", "rank 0"], ValueError, id="inclusive-ranks"),
    pytest.param(_too_many_workers, ["refused"], ValueError, id="too-many-workers"),
])
def test_setup_arguments(make_call, words, own_error, checks, comm):
    """Set-up arguments that differ between ranks, or that one rank's own check refuses:
    every rank raises (CollectiveMismatch, or that rank's own error), and a partition made
    afterwards works."""
    p = comm.size
    if p == 1:
        pytest.skip("needs ranks that disagree")
    checks.expect_everywhere(make_call(p, comm.rank), words, own_error=own_error)
    P = fastreduce.Partition().create_cartesian_topology_partition([p])
    checks.check(P.active and P.shape == (p,), "partition after the refused calls")
