"""fastreduce: zero-copy MPI all-reduce of DLPack tensors (torch, numpy, cupy, jax).

    import fastreduce
    fastreduce.allreduce_(grad)              # sum over all ranks, in place
    mean = fastreduce.allreduce(x, "avg")    # new tensor, x untouched

Launch with `mpiexec -n N python train.py` or `srun -n N python train.py`.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

from mpi4py import MPI as _MPI

from . import _abi

if _MPI.Is_finalized():  # the compiled core's set-up makes MPI calls: they would abort
    raise ImportError("fastreduce: MPI was finalized (MPI.Finalize() ran) before fastreduce "
                      "was imported; import fastreduce before finalizing MPI (mpi4py "
                      "finalizes it at exit by itself)")
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
    allgather,
    allreduce,
    allreduce_,
    allreduce_coalesced_,
    alltoall,
    broadcast_,
    default_comm,
    gather,
    iallgather,
    iallreduce,
    iallreduce_,
    ialltoall,
    ibroadcast_,
    igather,
    irecv,
    ireduce_,
    ireduce_scatter,
    iscatter,
    isend,
    recv,
    reduce_,
    reduce_scatter,
    scatter,
    send,
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

# The public names of the modules in torch/ and tools/, and the real modules they name: the
# one list of them. `import fastreduce.nn`, `from fastreduce import nn` and `fastreduce.nn`
# all give the module fastreduce.torch.nn itself (one object under both names; its
# submodules too: fastreduce.horovod.basics is fastreduce.torch.horovod.basics), loaded on
# first use, so the core works without torch. `python -m fastreduce.bench` runs the tool.
_PUBLIC_MODULES = {
    "autograd": "torch.autograd",
    "distdl": "torch.distdl",
    "distributed": "torch.distributed",
    "gradsync": "torch.gradsync",
    "horovod": "torch.horovod",
    "nn": "torch.nn",
    "ops": "torch.custom_ops",
    "bench": "tools.benchmark",
    "cluster": "tools.cluster",
    "info": "tools.info",
}

# Names of the torch layers that `fastreduce` itself offers, loaded on first use.
_TORCH_ATTRIBUTES = {
    "all_sum_reduce": "autograd",
    "all_reduce": "autograd",
    "zero_volume_tensor": "autograd",
    "GradientSync": "gradsync",
}


def _real_name(fullname: str) -> str | None:
    """The real module behind a public name (or a submodule of one), else None."""
    package, _, rest = fullname.partition(".")
    public, _, sub = rest.partition(".")
    if package != __name__ or public not in _PUBLIC_MODULES:
        return None
    return f"{__name__}.{_PUBLIC_MODULES[public]}" + (f".{sub}" if sub else "")


class _PublicNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import system's side of _PUBLIC_MODULES: finds a public name and loads it as the
    real module (imported under its own name, which it keeps)."""

    def find_spec(self, fullname, path=None, target=None):
        real = _real_name(fullname)
        if real is None:
            return None
        real_spec = importlib.util.find_spec(real)  # imports its parent packages (no torch)
        if real_spec is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, self, origin=real_spec.origin,
            is_package=real_spec.submodule_search_locations is not None)
        spec.loader_state = real_spec
        return spec

    def create_module(self, spec):
        module = importlib.import_module(spec.loader_state.name)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # the import system gave the module the public name's spec: it keeps its own
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname):
        """The real module's code (what `python -m fastreduce.bench` runs)."""
        real_spec = importlib.util.find_spec(_real_name(fullname))
        return real_spec.loader.get_code(real_spec.name)


if not any(type(f).__name__ == "_PublicNames" for f in sys.meta_path):  # once per process
    sys.meta_path.insert(0, _PublicNames())


def __getattr__(name: str):
    if name in _PUBLIC_MODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _TORCH_ATTRIBUTES:
        module = importlib.import_module(f".{_TORCH_ATTRIBUTES[name]}", __name__)
        value = getattr(module, name)
    else:
        raise AttributeError(f"module 'fastreduce' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


__all__ = [
    "iallgather",
    "ialltoall",
    "ibroadcast_",
    "igather",
    "ireduce_",
    "ireduce_scatter",
    "iscatter",
    "irecv",
    "isend",
    "send",
    "scatter",
    "reduce_scatter",
    "reduce_",
    "recv",
    "gather",
    "broadcast_",
    "alltoall",
    "allgather",
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
