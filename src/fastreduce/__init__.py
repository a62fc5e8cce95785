"""fastreduce: zero-copy MPI all-reduce of DLPack tensors (torch, numpy, cupy, jax).

    import fastreduce
    fastreduce.allreduce_(grad)              # sum over all ranks, in place
    mean = fastreduce.allreduce(x, "avg")    # new tensor, x untouched

Launch with `mpiexec -n N python train.py` or `srun -n N python train.py`.
"""

import importlib

from . import _abi

_abi.check()  # before any MPI call through a possibly mismatched library

from . import (  # noqa: E402, F401  (fastreduce.runtime without an import)
    algorithms,
    configure,
    gpupaths,
    runtime,
    watchdog,
)
from ._version import __version__  # noqa: E402
from .algorithms import set_algorithm  # noqa: E402
from .backend.buffer import result_cache_info, set_result_cache_limit  # noqa: E402
from .backend.collectives import (  # noqa: E402
    HAVE_LARGE_COUNT,
    Request,
    allreduce,
    allreduce_,
    allreduce_coalesced_,
    default_comm,
    iallreduce,
    iallreduce_,
    wait_all,
)
from .backend.mpierrors import build_mpi  # noqa: E402
from .backend.reductions import OP_NAMES, half_precision_paths, supports  # noqa: E402
from .checks import CollectiveMismatch, set_debug  # noqa: E402
from .errors import CalibrationError  # noqa: E402
from .gpupaths import cuda_aware, set_cuda_aware  # noqa: E402
from .partition import CartesianPartition, Partition  # noqa: E402
from .runtime import local_rank, local_size  # noqa: E402
from .watchdog import flight_record, set_timeout  # noqa: E402

configure.hand_down_settings()  # the compiled core's FASTREDUCE_* settings and hooks
set_debug(None)  # FASTREDUCE_DEBUG
watchdog._from_environment()  # FASTREDUCE_TIMEOUT, FASTREDUCE_FLIGHT_RECORD

# The torch layers load torch only when first used, so the core works without it.
_TORCH_ATTRIBUTES = {
    "all_sum_reduce": "autograd",
    "all_reduce": "autograd",
    "zero_volume_tensor": "autograd",
    "GradientSync": "gradsync",
}


def __getattr__(name: str):
    if name in ("nn", "autograd", "gradsync", "bench", "info", "distributed", "distdl", "ops"):
        value = importlib.import_module(f".{name}", __name__)
    elif name in _TORCH_ATTRIBUTES:
        module = importlib.import_module(f".{_TORCH_ATTRIBUTES[name]}", __name__)
        value = getattr(module, name)
    else:
        raise AttributeError(f"module 'fastreduce' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


__all__ = [
    "CalibrationError",
    "CartesianPartition",
    "CollectiveMismatch",
    "GradientSync",
    "HAVE_LARGE_COUNT",
    "Request",
    "OP_NAMES",
    "__version__",
    "all_reduce",
    "all_sum_reduce",
    "allreduce",
    "allreduce_",
    "allreduce_coalesced_",
    "cuda_aware",
    "build_mpi",
    "default_comm",
    "flight_record",
    "Partition",
    "half_precision_paths",
    "iallreduce",
    "iallreduce_",
    "local_rank",
    "local_size",
    "result_cache_info",
    "set_algorithm",
    "set_cuda_aware",
    "set_debug",
    "set_timeout",
    "set_result_cache_limit",
    "supports",
    "wait_all",
    "zero_volume_tensor",
]
