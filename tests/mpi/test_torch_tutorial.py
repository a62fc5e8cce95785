"""The programs of torch.distributed's introductory tutorial ("Writing Distributed
Applications with PyTorch"), unchanged but for the backend name: init_process_group with
MASTER_ADDR/MASTER_PORT, rank= and world_size= (torch's own env:// rendezvous), then
point-to-point (blocking and non-blocking), all_reduce over a new_group, broadcast, reduce,
all_gather, gather, scatter. Only the launcher differs: mpiexec starts the processes
instead of torch.multiprocessing, so rank and size come from MPI here (2 processes, as
written there)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import fastreduce.distributed  # noqa: F401  (registers the backend)

pytestmark = [pytest.mark.mpi(ranks=2), pytest.mark.one_mpi]

BACKEND = "fastreduce"


def init_process(rank, size, fn, backend=BACKEND):
    """Initialize the distributed environment (as the tutorial does)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ["TUTORIAL_PORT"]
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


@pytest.fixture(scope="module")
def tutorial():
    """init_process on every rank (a free port of rank 0's for MASTER_PORT), the cases then
    being the tutorial's run functions; MASTER_ADDR and MASTER_PORT are removed and the
    group destroyed at the module's end."""
    world = MPI.COMM_WORLD
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        port = None
    with pytest.MonkeyPatch.context() as env:  # what init_process sets, undone after
        env.setenv("TUTORIAL_PORT", str(world.bcast(port, root=0)))
        env.setenv("MASTER_ADDR", "")
        env.setenv("MASTER_PORT", "")
        init_process(world.rank, world.size, lambda rank, size: None)
        yield world.rank, world.size
        dist.destroy_process_group()


def blocking_p2p(f, rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    else:
        dist.recv(tensor=tensor, src=0)
    f.check(tensor[0].item() == 1.0, f"blocking p2p: rank {rank} has {tensor[0]}")


def nonblocking_p2p(f, rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        req = dist.isend(tensor=tensor, dst=1)
    else:
        req = dist.irecv(tensor=tensor, src=0)
    req.wait()
    f.check(tensor[0].item() == 1.0, f"non-blocking p2p: rank {rank} has {tensor[0]}")


def all_reduce_group(f, rank, size):
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    f.check(tensor[0].item() == 2.0, f"all_reduce over new_group: {tensor[0]}")


def broadcast(f, rank, size):
    t = torch.tensor([float(rank)])
    dist.broadcast(t, src=0)
    f.check(t.item() == 0.0, f"broadcast: {t}")


def reduce(f, rank, size):
    t = torch.tensor([float(rank + 1)])
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    if rank == 0:
        f.check(t.item() == size * (size + 1) / 2, f"reduce: {t}")


def all_gather(f, rank, size):
    gathered = [torch.zeros(1) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    f.check([g.item() for g in gathered] == list(map(float, range(size))), f"all_gather {gathered}")


def gather(f, rank, size):
    out = [torch.zeros(1) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), gather_list=out, dst=0)
    if rank == 0:
        f.check([g.item() for g in out] == list(map(float, range(size))), f"gather {out}")


def scatter(f, rank, size):
    piece = torch.zeros(1)
    scatter_list = [torch.tensor([float(10 * i)]) for i in range(size)] if rank == 0 else None
    dist.scatter(piece, scatter_list=scatter_list, src=0)
    f.check(piece.item() == 10.0 * rank, f"scatter: {piece}")


@pytest.mark.parametrize("program", [blocking_p2p, nonblocking_p2p, all_reduce_group, broadcast,
                                     reduce, all_gather, gather, scatter],
                         ids=lambda fn: fn.__name__)
def test_tutorial_program(tutorial, checks, program):
    """One of the tutorial's run functions, in the tutorial's order."""
    program(checks, *tutorial)


def test_backend_is_fastreduce(tutorial, checks):
    checks.check(dist.get_backend() == BACKEND, f"backend {dist.get_backend()}")
