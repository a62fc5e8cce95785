"""Rendezvous through MPI: rank, world size and the store's address come from MPI, so no
MASTER_ADDR or MASTER_PORT is needed."""

from __future__ import annotations

import datetime
import os
import socket
import sys
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from ... import watchdog
from ...backend import collectives as _collectives


def _mpi_rendezvous(url: str = "mpi://", timeout=None, **kwargs):
    """torch rendezvous handler: rank and world size from MPI; rank 0's TCPStore address
    broadcast over MPI. A rank or world size given to init_process_group must be MPI's."""
    world = _collectives.default_comm()
    rank, size = world.Get_rank(), world.Get_size()
    given = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    for key, mpi_value in (("rank", rank), ("world_size", size)):
        value = kwargs.get(key, given.get(key, "-1"))
        if int(value) not in (-1, mpi_value):
            raise ValueError(f"fastreduce backend: {key}={value} but MPI says {mpi_value} "
                             f"(rank {rank} of {size} in fastreduce.default_comm()); leave "
                             f"{key} out under mpiexec or srun")
    timeout = timeout or datetime.timedelta(minutes=30)
    if rank == 0:
        store = dist.TCPStore(socket.gethostname(), 0, size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        address = (socket.gethostname(), store.port)
    else:
        address = None
    with watchdog.recorded("rendezvous: the store's address (MPI_Bcast)", world):
        address = world.bcast(address, root=0)
    if rank != 0:
        store = dist.TCPStore(address[0], address[1], size, is_master=False, timeout=timeout)
    yield store, rank, size


def _env_or_mpi(url: str, timeout=None, **kwargs):
    """env:// as torch does it when MASTER_ADDR is set; else the rendezvous through MPI."""
    if "MASTER_ADDR" in os.environ or "TORCHELASTIC_USE_AGENT_STORE" in os.environ:
        return _torch_env_handler(url, timeout=timeout, **kwargs)
    return _mpi_rendezvous(url, timeout=timeout, **kwargs)


_rendezvous_module = sys.modules["torch.distributed.rendezvous"]
_torch_env_handler = _rendezvous_module._rendezvous_handlers.get("env")
