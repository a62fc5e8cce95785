"""Creating process groups: torch's creator for the backend, and groups over existing
communicators."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch.distributed as dist
from mpi4py import MPI

from ... import watchdog
from ...backend import collectives as _collectives
from .processgroup import BACKEND, ProcessGroupFastreduce

_adopt = threading.local()  # a communicator the next group creation takes as it is


def _create(options, backend_options=None) -> ProcessGroupFastreduce:
    """torch's creator: the world (a duplicate of fastreduce.default_comm()) or a new group
    of the given ranks (MPI_Comm_create_group, collective over its members only)."""
    comm = getattr(_adopt, "comm", None)
    _adopt.comm = None
    world = _collectives.default_comm()
    ranks = list(options.global_ranks_in_group)
    if comm is None:
        if not ranks or ranks == list(range(world.Get_size())):
            with watchdog.recorded("MPI_Comm_dup: a process group", world):
                comm = world.Dup()
        else:
            group = world.Get_group()
            try:
                subgroup = group.Incl(ranks)
                try:
                    with watchdog.recorded(f"MPI_Comm_create_group: ranks {ranks}", world):
                        comm = world.Create_group(subgroup, tag=_GROUP_TAG)
                finally:
                    subgroup.Free()
            finally:
                group.Free()
    if (options.group_rank, options.group_size) != (comm.Get_rank(), comm.Get_size()):
        raise ValueError(
            f"fastreduce backend: torch gave rank {options.group_rank} of {options.group_size} "
            f"but MPI has rank {comm.Get_rank()} of {comm.Get_size()}; launch with mpiexec or "
            f"srun and leave rank and world_size out (they come from MPI)")
    return ProcessGroupFastreduce(comm, timeout=options.timeout)


_GROUP_TAG = 0x7A11


def process_group(comm: MPI.Intracomm, ranks: Sequence[int] | None = None):
    """A torch process group over an existing communicator (e.g. a Partition's cached
    sub-communicator): called by the communicator's members only. `ranks`: its members'
    ranks in torch's world, found from MPI when omitted."""
    if comm == MPI.COMM_NULL:
        raise ValueError("fastreduce backend: this worker is not in the communicator "
                         "(MPI.COMM_NULL); only its members call process_group()")
    if not dist.is_initialized():
        raise RuntimeError("fastreduce backend: call dist.init_process_group('fastreduce') "
                           "first")
    if ranks is None:
        world = _collectives.default_comm()
        ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                          world.Get_group())
    _adopt.comm = comm
    try:
        return dist.new_group(list(ranks), backend=BACKEND, use_local_synchronization=True)
    finally:
        _adopt.comm = None
