"""The seed example, as written apart from imports, checked against a reference.

Each worker's x is seeded by its rank in P_x; every rank rebuilds the inputs of
the 6 workers that share its first coordinate and sums them with numpy.
"""

import numpy as np
import torch
from common import WORLD, Failures
from mpi4py import MPI

import fastreduce

fails = Failures()

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
    fails.check(len(partners) == 6, f"partners {partners}")
    fails.check(y.shape == x.shape and y.dtype == x.dtype, f"y {y.shape} {y.dtype}")
    err = float(np.max(np.abs(y.double().numpy() - want)))
    fails.check(err <= 6 * 2**-24 * 6, f"y differs from the reference sum by {err}")
    fails.check(P_x.shape == (2, 2, 3) and P_x.size == 12, f"{P_x.shape} {P_x.size}")
    fails.check(list(P_x.coords) == list(np.unravel_index(P_x.rank, (2, 2, 3))),
                f"coords {P_x.coords} of rank {P_x.rank}")
else:
    fails.check(WORLD.rank >= 12, f"rank {WORLD.rank} inactive")
    fails.check(y.numel() == 0 and y is not x, "inactive worker's result is a clone")
    fails.check(P_x.comm == MPI.COMM_NULL and not P_x.active, "inactive partition")
fails.finish()
