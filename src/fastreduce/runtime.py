"""Where this process runs: node-local rank, whether the MPI can read GPU memory (see
fastreduce.gpupath), and the GPU paths' settings and counters, in one place.

Everything comes from MPI itself, never from launcher variables, so it is the
same under mpiexec, srun or any other launcher.
"""

from __future__ import annotations

import functools

from mpi4py import MPI

from . import watchdog
from .backend.cudart import copy_counts as gpu_copy_counts
from .backend.cudart import plan_staging, set_staging_chunk
from .backend.cudart import reset_copy_counts as reset_gpu_copy_counts
from .backend.cudart import runtime_info as cuda_runtime_info
from .backend.reduce import segment_bytes, set_segment_bytes
from .calibration import calibrate
from .errors import CalibrationError
from .gpupath import (
    cuda_aware,
    gpu_path_settings,
    set_cuda_aware,
    set_device_pointer_calls,
    set_gpu_path,
    set_gpu_thresholds,
)

__all__ = ["CalibrationError", "calibrate", "cuda_aware", "cuda_runtime_info",
           "gpu_copy_counts", "gpu_path_settings", "local_rank", "local_size", "plan_staging",
           "reset_gpu_copy_counts", "segment_bytes", "set_cuda_aware",
           "set_device_pointer_calls", "set_gpu_path", "set_gpu_thresholds", "set_segment_bytes",
           "set_staging_chunk"]


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
