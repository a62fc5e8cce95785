"""torch.distributed on MPI: a process-group backend named "fastreduce".

    import fastreduce.distributed              # registers the backend
    dist.init_process_group("fastreduce")      # under mpiexec or srun: nothing else to set

Rank and world size come from MPI (fastreduce.default_comm()), and so does the rendezvous:
where the launcher did not set them, the import sets RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE as torchrun would (collective: every rank imports it), so scripts written
for torchrun run unchanged under mpiexec and srun. The rendezvous:
rank 0's address for torch's key-value store travels by MPI_Bcast, so no MASTER_ADDR or
MASTER_PORT is needed (when they are set, torch's own env:// rendezvous runs as usual, and
rank/world_size given to init_process_group must equal MPI's).

Every operation is one MPI call on the group's communicator with the tensors' own memory:
every collective and point-to-point call through fastreduce's compiled core (zero-copy
DLPack, GPU paths as for allreduce, the progress engine for non-blocking requests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import partition
from ..._version import __version__
from ...errors import BackendError
from ..versions import _release, _torch_refusal

# Checked before the submodules load, so a torch the backend is not made for fails here,
# by name (docs/install.md: what differs on each).
_REFUSAL = _torch_refusal(_release(torch.__version__))
if _REFUSAL:
    raise ImportError(f"fastreduce.distributed: {_REFUSAL} (this is torch "
                      f"{torch.__version__})")

from .groups import _create, process_group  # noqa: E402
from .hooks import bf16_compression_hook, fp16_compression_hook  # noqa: E402
from .processgroup import BACKEND, ProcessGroupFastreduce  # noqa: E402
from .rendezvous import (  # noqa: E402
    _env_or_mpi,
    _mpi_rendezvous,
    _rendezvous_module,
    _torch_env_handler,
    export_torchrun_environment,
)
from .work import Work  # noqa: E402


def _register() -> None:
    partition.set_process_group_factory(process_group)  # Partition.process_group()'s maker
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    handlers = _rendezvous_module._rendezvous_handlers
    if "mpi" not in handlers:
        dist.register_rendezvous_handler("mpi", _mpi_rendezvous)
    if _torch_env_handler is not None and handlers.get("env") is _torch_env_handler:
        handlers["env"] = _env_or_mpi  # only changes what would have failed: no MASTER_ADDR
    export_torchrun_environment()


_register()

__all__ = ["BACKEND", "BackendError", "ProcessGroupFastreduce", "Work",
           "bf16_compression_hook", "fp16_compression_hook", "process_group", "__version__"]
