"""Calls after MPI.Finalize(): each raises RuntimeError naming the cause (the process
aborted inside MPI before). Prints "rank N: ok" when every call did."""

import numpy as np
from mpi4py import MPI

import fastreduce

RANK = MPI.COMM_WORLD.Get_rank()
x = np.ones(8)
fastreduce.allreduce_(x)  # the default communicator made and used
MPI.Finalize()

failures = []
calls = {
    "allreduce_": lambda: fastreduce.allreduce_(x),
    "allreduce_ on COMM_WORLD": lambda: fastreduce.allreduce_(x, comm=MPI.COMM_WORLD),
    "broadcast_": lambda: fastreduce.broadcast_(x),
    "iallreduce": lambda: fastreduce.iallreduce(x),
    "send": lambda: fastreduce.send(x, 0),
    "default_comm": fastreduce.default_comm,
}
for name, call in calls.items():
    try:
        call()
    except RuntimeError as exc:
        if "MPI has been finalized" not in str(exc):
            failures.append(f"{name}: {exc}")
    else:
        failures.append(f"{name}: nothing raised")
for text in failures:
    print(f"rank {RANK}: FAILED {text}", flush=True)
print(f"rank {RANK}: {'ok' if not failures else 'failed'}", flush=True)
