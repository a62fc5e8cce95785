"""fastreduce: zero-copy MPI all-reduce of DLPack tensors (torch, numpy, cupy, jax).

    import fastreduce
    fastreduce.allreduce_(grad)              # sum over all ranks, in place
    mean = fastreduce.allreduce(x, "avg")    # new tensor, x untouched

Launch with `mpiexec -n N python train.py` or `srun -n N python train.py`.
"""

from . import _abi

_abi.check()  # before any MPI call through a possibly mismatched library

from ._buffer import result_cache_info, set_result_cache_limit  # noqa: E402
from ._collectives import HAVE_LARGE_COUNT, allreduce, allreduce_, default_comm  # noqa: E402
from ._errors import build_mpi  # noqa: E402
from ._ops import OP_NAMES, half_precision_paths, supports  # noqa: E402
from ._version import __version__  # noqa: E402

__all__ = [
    "HAVE_LARGE_COUNT",
    "OP_NAMES",
    "__version__",
    "allreduce",
    "allreduce_",
    "build_mpi",
    "default_comm",
    "half_precision_paths",
    "result_cache_info",
    "set_result_cache_limit",
    "supports",
]
