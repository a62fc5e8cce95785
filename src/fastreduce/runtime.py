"""Where this process runs: node-local rank, whether the MPI can read GPU memory, and
the GPU paths' settings (see fastreduce.gpupath) and counters.

Everything comes from MPI itself, never from launcher variables, so it is the
same under mpiexec, srun or any other launcher.
"""

from __future__ import annotations

import functools
import os

from mpi4py import MPI

from .backend import pathchoice as _gpupath
from . import watchdog
from .backend.cudart import copy_counts as gpu_copy_counts
from .backend.cudart import plan_staging, set_staging_chunk
from .backend.cudart import reset_copy_counts as reset_gpu_copy_counts
from .backend.cudart import runtime_info as cuda_runtime_info
from .backend.reduce import segment_bytes, set_segment_bytes
from .gpupath import (
    CalibrationError,
    calibrate,
    gpu_path_settings,
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


_override: bool | None = None


def set_cuda_aware(value: bool | None) -> None:
    """Declare whether the MPI can read GPU memory (None: detect again).

    The GPU paths ask cuda_aware() once, at their first call, and keep the answer
    until this is called; FASTREDUCE_CUDA_AWARE is read then too.
    """
    global _override
    _override = None if value is None else bool(value)
    _gpupath.forget()


def cuda_aware() -> tuple[bool, str]:
    """(answer, how it was reached): the Python switch, FASTREDUCE_CUDA_AWARE, the MPI's
    own query (MPIX_Query_cuda_support / MPIX_GPU_query_support / the MPI 4.1
    mpi_memory_alloc_kinds info), else not CUDA-aware."""
    if _override is not None:
        return _override, "fastreduce.set_cuda_aware()"
    setting = os.environ.get("FASTREDUCE_CUDA_AWARE")
    if setting is not None and setting.strip() != "":
        if setting.strip() not in ("0", "1"):
            raise ValueError(f"FASTREDUCE_CUDA_AWARE={setting!r}: use 0 or 1")
        return setting.strip() == "1", "FASTREDUCE_CUDA_AWARE"
    from .backend import mpierrors as _errors

    answer = _errors.mpi_cuda_query()
    if answer is not None:
        return answer
    kinds = _memory_alloc_kinds()
    if kinds is not None:
        return ("cuda" in kinds.split(",") or any(k.startswith("cuda:") for k in
                                                  kinds.split(","))), \
            f"mpi_memory_alloc_kinds={kinds!r}"
    return False, "no query available in this MPI: assumed not CUDA-aware"


def _memory_alloc_kinds() -> str | None:
    try:
        info = MPI.COMM_WORLD.Get_info()
    except MPI.Exception:
        return None
    try:
        return info.Get("mpi_memory_alloc_kinds")
    finally:
        info.Free()
