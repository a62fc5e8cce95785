"""An uncaught exception on one rank of a fastreduce.horovod program (tests/launch/
test_horovod_exit.py runs it on 2 ranks, without `python -m mpi4py`): rank 1 raises while
rank 0 waits in hvd.barrier(). The job must end (MPI_Abort) rather than rank 1 wait in
MPI_Finalize for rank 0, and rank 0 in the barrier for rank 1, for ever."""

from __future__ import annotations

import torch

import fastreduce.horovod as hvd

hvd.init()
hvd.allreduce(torch.ones(2))
if hvd.rank() == 1:
    raise RuntimeError("rank 1 fails here")
hvd.barrier()
print("not reached in the test: rank 0 left the barrier", flush=True)
