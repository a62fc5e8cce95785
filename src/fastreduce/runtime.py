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


# The GPU path names this module used to hold, for a clear error in code written for them.
_MOVED_TO_GPUPATHS = frozenset({
    "set_gpu_path", "set_gpu_thresholds", "set_device_pointer_calls", "gpu_path_settings",
    "calibrate", "CalibrationError", "gpu_copy_counts", "reset_gpu_copy_counts",
    "plan_staging", "set_staging_chunk", "cuda_runtime_info", "cuda_aware", "set_cuda_aware"})


def __getattr__(name: str):
    if name in _MOVED_TO_GPUPATHS:
        raise AttributeError(f"fastreduce.runtime.{name} has moved: use "
                             f"fastreduce.gpupaths.{name}")
    raise AttributeError(f"module 'fastreduce.runtime' has no attribute {name!r}")
