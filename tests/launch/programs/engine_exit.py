"""Requests still pending at interpreter exit, over the fake CUDA runtime
(tests/launch/test_engine_exit.py runs it on 3 ranks with FASTREDUCE_CUDART set).

Every rank starts staged GPU requests and exits without waiting: some kept, some dropped
at once. An atexit hook, registered before fastreduce's own (so it runs after them: atexit
handlers run last-registered first), checks that they were delivered, then that a request
started after the engine stopped still works (it runs in this thread). Each rank prints
"delivered at exit: <ok>" and "request after the engine stopped: <ok>".
"""

from __future__ import annotations

import atexit
import sys

EXIT_CHECKS = []  # run at exit after fastreduce's own handlers
atexit.register(lambda: [check() for check in EXIT_CHECKS])  # before fastreduce registers

import numpy as np  # noqa: E402
from fakecuda import FakeCudaArray  # noqa: E402
from mpi4py import MPI  # noqa: E402

import fastreduce  # noqa: E402

rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
fastreduce.set_cuda_aware(False)


def values_of(n: int, r: int, dtype=np.float32, salt: int = 0) -> np.ndarray:
    return ((np.arange(n) * 7 + r * 3 + salt) % 5 + 1).astype(dtype)


def summed(n: int, ranks, dtype=np.float32, salt: int = 0) -> np.ndarray:
    return sum(values_of(n, r, dtype, salt).astype(np.float64) for r in ranks).astype(dtype)


arrays = [FakeCudaArray.from_numpy(values_of(n, rank, salt=n)) for n in (10, 3000, 300_000)]
requests = [fastreduce.iallreduce_(a) for a in arrays]
dropped = [FakeCudaArray.from_numpy(values_of(n, rank, salt=n)) for n in (20, 200_000)]
for a in dropped:
    fastreduce.iallreduce_(a)  # dropped at once, still pending at exit
arrays += dropped


def delivered():
    ok = all(np.array_equal(a.to_numpy(), summed(a.size, range(size), salt=a.size))
             for a in arrays)
    print(f"[rank {rank}] delivered at exit: {ok}", flush=True)


EXIT_CHECKS.append(delivered)


def late_request():  # after the engine stopped: it runs in this thread
    late = FakeCudaArray.from_numpy(values_of(5000, rank))
    ok = np.array_equal(fastreduce.iallreduce_(late).wait().to_numpy(),
                        summed(5000, range(size)))
    print(f"[rank {rank}] request after the engine stopped: {ok}", flush=True)


EXIT_CHECKS.append(late_request)
print(f"[rank {rank}] started {len(requests)} requests, exiting", flush=True)
sys.exit(0)
