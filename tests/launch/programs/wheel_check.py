"""Run from a merged wheel (tools/wheel.sh): the build for the MPI that mpi4py loaded is
the one in use, and the core's all-reduce, all-gather and broadcast give the right data.
argv[1]: the variant expected ("openmpi" or "mpich")."""

import sys

import numpy as np
from mpi4py import MPI

import fastreduce
from fastreduce.backend import collectives, variants

rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
want = sys.argv[1]
assert variants.in_use().startswith(f"the wheel's {want} build"), variants.in_use()
assert f"/backend/_{want}/" in collectives.__file__, collectives.__file__
x = np.full(5, rank + 1.0, np.float32)
fastreduce.allreduce_(x)
assert x.tolist() == [size * (size + 1) / 2] * 5, x
g = fastreduce.allgather(np.full(3, float(rank), np.float64))
assert g.tolist() == [float(r) for r in range(size) for _ in range(3)], g
b = np.arange(4, dtype=np.int32) * (rank + 1)
fastreduce.broadcast_(b, size - 1)
assert b.tolist() == [i * size for i in range(4)], b
print(f"rank {rank}: {variants.in_use()}, {size} ranks: ok", flush=True)
