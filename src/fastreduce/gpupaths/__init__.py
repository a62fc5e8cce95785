"""How fastreduce reduces CUDA tensors: the GPU path choice, in one place.

A CUDA tensor is reduced one of two ways:

- **direct**: its device pointer goes to MPI (no copies; the MPI reads GPU memory);
- **staged**: device -> pinned host memory -> MPI on the host -> device, pipelined
  in chunks for large messages.

Direct is allowed only where the MPI promises to take device pointers for that kind of
call (`capabilities`: Open MPI only in blocking collectives, for instance); everything
else is staged, whatever the settings say. Among the calls where both are allowed,
``FASTREDUCE_GPU_PATH`` (``auto``, ``direct``, ``staged``) decides; ``auto`` follows a
size table (`modes`): pinned by ``FASTREDUCE_GPU_THRESHOLDS`` (or a file named by
``FASTREDUCE_GPU_THRESHOLDS_FILE``), else measured by `calibrate` the first time a
communicator's group needs it (collective, well under a second; `calibration`) and kept
for the process. Every rank of a communicator must reach the same choice, so its first
GPU call agrees on the settings (`agreement`).

The choice itself is made per call in the compiled core (``backend/pathchoice.pyx``),
from what the ranks agreed on; this package is the only part of the Python core that
talks to it. Settings are read at the first GPU call; the ``set_*`` functions change them
later.
"""

from __future__ import annotations

from ..backend import cudart, pathchoice
from ..backend.cudart import plan_staging, set_staging_chunk
from ..backend.cudart import runtime_info as cuda_runtime_info
from ..errors import CalibrationError
from .calibration import CALIBRATION_SIZES, Calibration, calibrate, calibrated_tables
from .capabilities import (
    CAPABILITY_TABLE,
    DevicePointerSupport,
    cuda_aware,
    device_pointer_support,
    mpi_promises,
    set_cuda_aware,
    set_device_pointer_calls,
)
from .modes import (
    MODES,
    PATHS,
    PathTable,
    gpu_path_mode,
    pinned_thresholds,
    set_gpu_path,
    set_gpu_thresholds,
)

__all__ = [
    "CALIBRATION_SIZES",
    "CAPABILITY_TABLE",
    "MODES",
    "PATHS",
    "Calibration",
    "CalibrationError",
    "DevicePointerSupport",
    "PathTable",
    "calibrate",
    "cuda_aware",
    "cuda_runtime_info",
    "device_pointer_support",
    "gpu_copy_counts",
    "gpu_path_mode",
    "gpu_path_settings",
    "mpi_promises",
    "pinned_thresholds",
    "plan_staging",
    "reset_gpu_copy_counts",
    "set_cuda_aware",
    "set_device_pointer_calls",
    "set_gpu_path",
    "set_gpu_thresholds",
    "set_staging_chunk",
]


def gpu_path_settings() -> dict:
    """Everything that decides the GPU path here, in words (for fastreduce-info)."""
    mode, mode_source = gpu_path_mode()
    support = device_pointer_support()
    pinned = pinned_thresholds()
    calibrated = calibrated_tables()
    if pinned is not None:
        table = f"{pinned.spec()} (pinned by {pinned.source})"
    elif calibrated:
        table = "; ".join(f"{ranks} ranks: {t.spec()}" for ranks, t in calibrated)
        table += " (calibrated)"
    else:
        table = "calibrated at the first eligible call on each communicator group"
    return {"mode": f"{mode} ({mode_source})",
            "device pointers": f"{support.calls()} ({support.why})",
            "size table": table if mode == "auto" else f"not used in {mode} mode"}


def gpu_copy_counts() -> dict:
    """Copies, host waits and the path of each call (direct_calls: device pointers to MPI;
    staged_calls: through pinned memory) made by the GPU paths since
    reset_gpu_copy_counts()."""
    return {**cudart.copy_counts(), **pathchoice.path_counts()}


def reset_gpu_copy_counts() -> None:
    """Zero gpu_copy_counts() (pinned_bytes, the memory held now, is kept)."""
    cudart.reset_copy_counts()
    pathchoice.reset_path_counts()
