"""fastreduce.distdl: DistDL's partition conventions and names, checked on any number of ranks."""

from __future__ import annotations

import numpy as np
import torch
from common import WORLD, Failures
from mpi4py import MPI

import fastreduce
from fastreduce.distdl import (
    AllSumReduce,
    MPICartesianPartition,
    MPIPartition,
    zero_volume_tensor,
)

fails = Failures()
check, expect = fails.check, fails.expect
p, rank = WORLD.size, WORLD.rank

# the inactive placeholder: DistDL's values
empty = MPIPartition()
check(not empty.active and empty.rank == MPI.PROC_NULL and empty.size == -1
      and empty.comm == MPI.COMM_NULL and empty.index is None, "MPIPartition() is inactive")
check(isinstance(empty.shape, np.ndarray) and list(empty.shape) == [-1] and empty.dim == 1,
      f"inactive shape {empty.shape}")
check(empty != empty and empty != MPIPartition(), "an inactive partition equals nothing")

world = MPIPartition(MPI.COMM_WORLD)
check(world.active and world.rank == rank and world.size == p and world.index == rank,
      "MPIPartition(COMM_WORLD)")
check(world._comm is world.comm and MPI.Comm.Compare(world.comm, WORLD) == MPI.IDENT,
      "comm and DistDL's _comm")
check(world == MPIPartition(MPI.COMM_WORLD) and world != empty, "== over one communicator")
check({world: 1}.get(MPIPartition(MPI.COMM_WORLD)) == 1, "equal partitions hash alike")
check(isinstance(world.native, fastreduce.Partition), "native partition")

# zero_volume_tensor: DistDL's order (b, dtype, requires_grad, device)
t = zero_volume_tensor(None, torch.float64, True)
check(t.shape == (0,) and t.dtype == torch.float64 and t.requires_grad, "zvt(None, f64, True)")
t = zero_volume_tensor(3, None, False, torch.device("meta"))
check(t.shape == (3, 0) and t.device.type == "meta" and not t.requires_grad
      and t.dtype == torch.get_default_dtype(), f"zvt(3, None, False, meta): {t}")

# a 2-d grid over every rank: shape and index are numpy arrays
rows = 2 if p % 2 == 0 else 1
cols = p // rows
coords = np.unravel_index(rank, (rows, cols))
P = world.create_cartesian_topology_partition([rows, cols])
check(isinstance(P, MPICartesianPartition) and P.dim == 2 and P.size == p, "Cartesian")
check(isinstance(P.shape, np.ndarray) and np.array_equal(P.shape * 2, [2 * rows, 2 * cols])
      and bool(np.all(P.shape == [rows, cols])), f"shape {P.shape} is not a numpy array")
check(isinstance(P.index, np.ndarray) and list(P.index) == list(coords), f"index {P.index}")
check(all(list(P.cartesian_index(r)) == list(np.unravel_index(r, (rows, cols)))
          for r in range(p)), "cartesian_index")
check(P.native.shape == (rows, cols), "the native partition keeps tuples")
expect(ValueError, ["rank", str(p)], lambda: P.cartesian_index(p))


def neighbours(index, shape, periods):
    out = []
    for axis in range(len(shape)):
        pair = []
        for step in (-1, 1):
            c = list(index)
            c[axis] += step
            if not 0 <= c[axis] < shape[axis]:
                if not periods[axis]:
                    pair.append(MPI.PROC_NULL)
                    continue
                c[axis] %= shape[axis]
            pair.append(int(np.ravel_multi_index(c, shape)))
        out.append(tuple(pair))
    return out


check(all(P.neighbor_ranks(r) == neighbours(np.unravel_index(r, (rows, cols)), (rows, cols),
                                            (False, False)) for r in range(p)),
      f"neighbor_ranks {P.neighbor_ranks(rank)}")
ring = world.create_cartesian_topology_partition([rows, cols], periods=[False, True])
check(ring.neighbor_ranks(rank) == neighbours(coords, (rows, cols), (False, True)),
      f"periodic neighbor_ranks {ring.neighbor_ranks(rank)}")

# ==: same communicator and rank
check(P == P and P == MPIPartition(P.comm) and P != world and P != ring, "== of partitions")

# reorder= is accepted (MPI may reorder; fastreduce keeps every rank's place)
R = world.create_cartesian_topology_partition(np.array([rows, cols]), reorder=True)
check(R.active and list(R.index) == list(coords) and R != P, "reorder=True")
expect(TypeError, ["unexpected keyword"],
       lambda: world.create_cartesian_topology_partition([p], colour=1))

# create_allreduction_partition(axes_reduce): the workers sharing the other coordinates
for axes in [(), (0,), (1,), (0, 1)]:
    A = P.create_allreduction_partition(axes)
    want_shape = [rows if 0 in axes else 1, cols if 1 in axes else 1]
    members = [r for r in range(p) if all(np.unravel_index(r, (rows, cols))[k] == coords[k]
                                          for k in range(2) if k not in axes)]
    got = A.comm.allgather(rank) if A.active else None
    check(isinstance(A, MPICartesianPartition) and list(A.shape) == want_shape
          and A.size == len(members) and got == members,
          f"create_allreduction_partition({axes}): shape {A.shape}, members {got}")
    check(list(A.index) == [coords[k] if k in axes else 0 for k in range(2)],
          f"create_allreduction_partition({axes}): index {A.index}")
    A.deactivate()
    check(not A.active and A.comm == MPI.COMM_NULL and A.rank == MPI.PROC_NULL
          and A.size == -1 and list(A.shape) == want_shape and A.index is None,
          f"deactivate() of the all-reduction partition {axes}")
expect(ValueError, ["axes_reduce", "out of range"], lambda: P.create_allreduction_partition([2]))

# sub-topologies: the cached sub-communicator; deactivating one leaves the parent alone
S = P.create_cartesian_subtopology_partition([False, True])
check(list(S.shape) == [cols] and S.size == cols and list(S.index) == [coords[1]],
      f"subtopology {S.shape} {S.index}")
S_all = P.create_cartesian_subtopology_partition(np.array([True, True]))
check(S_all == P and S_all is not P, "subtopology keeping every axis")
S.deactivate()
S_all.deactivate()
check(P.active and P.comm != MPI.COMM_NULL and P.comm.allreduce(1) == p,
      "a deactivated sub-partition freed its parent's communicator")

# AllSumReduce: DistDL's attributes; the sum over each row
layer = AllSumReduce(P, axes_reduce=(1,))
check(layer.P_x is P and layer.axes_reduce == (1,) and layer.axes_keep == (0,)
      and layer.identity == (cols == 1), "AllSumReduce attributes")
same = AllSumReduce(P, axes_keep=[0])
check(same.axes_reduce == (1,) and same.axes_keep == (0,), "axes_keep=")
expect(ValueError, ["exactly one"], lambda: AllSumReduce(P, axes_reduce=(1,), axes_keep=(0,)))
expect(ValueError, ["exactly one"], lambda: AllSumReduce(P))
x = torch.rand(4, 3, generator=torch.Generator().manual_seed(500 + rank), dtype=torch.float64)
everyone = WORLD.allgather(x.numpy())
want = sum(everyone[r] for r in range(p) if r // cols == coords[0])
x.requires_grad = True
y = layer(x)
check(np.allclose(y.detach().numpy(), want, rtol=1e-14, atol=0), "AllSumReduce values")
y.backward(torch.ones_like(y))
check(bool(torch.all(x.grad == cols)), f"AllSumReduce backward {x.grad[0]}")
# where fastreduce is stricter or right, the compatibility layer is too: transposed
# inputs, bfloat16, and the (expanded, stride-0) gradient of y.sum()
xt = x.detach().t().clone().requires_grad_()
yt = layer(xt.t())
check(np.allclose(yt.detach().numpy(), want, rtol=1e-14, atol=0), "transposed input")
yt.sum().backward()
check(bool(torch.all(xt.grad == cols)), "the gradient of y.sum()")
yb = layer(x.detach().bfloat16())
check(yb.dtype == torch.bfloat16 and np.allclose(yb.float().numpy(), want, rtol=2**-7 * cols),
      "bfloat16")

# deactivate() frees the partition's communicator and its cached sub-communicators
D = world.create_cartesian_topology_partition([rows, cols])
sub = AllSumReduce(D, axes_reduce=(1,)).comm
check(sub != MPI.COMM_NULL, "the layer's sub-communicator")
D.deactivate()
check(sub == MPI.COMM_NULL and not D.active and D.rank == MPI.PROC_NULL and D.size == -1
      and list(D.shape) == [rows, cols] and D.index is None, "deactivate() of a Cartesian")

# workers outside a partition: inactive values; fastreduce asks for a zero-volume tensor
first = world.create_partition_inclusive([0])
P0 = first.create_cartesian_topology_partition([1])
layer0 = AllSumReduce(P0, axes_reduce=(0,))
if rank == 0:
    check(P0.active and layer0.identity and list(P0.index) == [0], "1-worker partition")
    y0 = layer0(x)
    check(torch.equal(y0, x) and y0 is not x, "identity layer returns a copy")
else:
    check(not first.active and first.rank == MPI.PROC_NULL and first.size == -1,
          "inactive inclusive partition")
    check(not P0.active and list(P0.shape) == [1] and P0.index is None and not layer0.identity,
          "inactive Cartesian partition")
    check(not P0.create_allreduction_partition((0,)).active, "inactive all-reduction partition")
    expect(ValueError, ["not in it"], lambda: P0.cartesian_index(0))
    z = zero_volume_tensor(requires_grad=True)
    check(layer0(z).numel() == 0, "an inactive worker's result")
    expect(ValueError, ["zero-volume"], lambda: layer0(torch.ones(2)))
for part in (P0, first, R, ring, P):
    part.deactivate()
fails.finish()
