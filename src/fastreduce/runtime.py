"""Where this process runs, and the host all-reduce's segment size: node-local rank and
size, `segment_bytes` and `set_segment_bytes`. The GPU paths' questions and switches (whether
the MPI can read GPU memory, the path settings, the counters) are `fastreduce.gpupaths`'.

Everything comes from MPI itself, never from launcher variables, so it is the
same under mpiexec, srun or any other launcher.
"""

from __future__ import annotations

import functools

from mpi4py import MPI

from . import watchdog
from .backend.reduce import segment_bytes, set_segment_bytes

__all__ = ["local_rank", "local_size", "segment_bytes", "set_segment_bytes"]


@functools.cache
def _node_comm() -> MPI.Intracomm:
    """COMM_WORLD split by shared-memory node (MPI_Comm_split_type), made once (collective)."""
    with watchdog.recorded("MPI_Comm_split_type: the node's ranks", MPI.COMM_WORLD):
        return MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=MPI.COMM_WORLD.Get_rank())


def local_rank() -> int:
    """This rank's index among the ranks on its node, e.g. for
    torch.cuda.set_device(fastreduce.local_rank() % torch.cuda.device_count())."""
    return _node_comm().Get_rank()


def local_size() -> int:
    """How many ranks share this node."""
    return _node_comm().Get_size()
