"""Communicators (default, world, split, self, Cartesian), MPI.Op arguments and
MPI-reported errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import fastreduce

pytestmark = [pytest.mark.mpi(ranks=(1, 2, 3, 4)), pytest.mark.across_nodes]

MPI_OPS = [(MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MIN, "min"), (MPI.MAX, "max"),
           (MPI.BAND, "band"), (MPI.BOR, "bor"), (MPI.BXOR, "bxor")]
LOGICAL_OPS = [(MPI.LAND, "band"), (MPI.LOR, "bor"), (MPI.LXOR, "bxor")]


def test_default_communicator(checks, comm):
    """The default communicator: a duplicate of COMM_WORLD, made once."""
    default = fastreduce.default_comm()
    checks.check(default is fastreduce.default_comm(), "default_comm() made twice")
    checks.check(MPI.Comm.Compare(default, comm) == MPI.CONGRUENT,
                 "default communicator is not a duplicate of COMM_WORLD")
    checks.check(default.Get_errhandler() == MPI.ERRORS_RETURN, "default comm errhandler")


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_user_message_untouched(checks, comm):
    """A message of the user's own on COMM_WORLD, sent before our collectives run,
    arrives untouched after them: our traffic is on another context."""
    rank, size = comm.rank, comm.size
    peer = (rank + 1) % size
    request = comm.isend(("user", rank), dest=peer, tag=11)
    x = torch.full((5,), float(rank))
    fastreduce.allreduce_(x)
    got = comm.recv(source=(rank - 1) % size, tag=11)
    request.wait()
    checks.check(got == ("user", (rank - 1) % size), f"user message {got}")
    checks.check(torch.equal(x, torch.full((5,), float(sum(range(size))))),
                 "sum beside user msg")


def test_world_and_self(checks, comm):
    """comm=COMM_WORLD and comm=COMM_SELF."""
    size = comm.size
    x = torch.arange(4, dtype=torch.float64) + comm.rank
    checks.check(torch.equal(fastreduce.allreduce(x, comm=comm),
                             size * torch.arange(4, dtype=torch.float64) + sum(range(size))),
                 "world")
    checks.check(torch.equal(fastreduce.allreduce(x, comm=MPI.COMM_SELF), x), "self")


def test_split_communicator(checks, comm):
    """A split communicator: sum over its members, avg divided by its size."""
    rank, size = comm.rank, comm.size
    color = rank % 2
    half = comm.Split(color, rank)
    members = [r for r in range(size) if r % 2 == color]
    got = fastreduce.allreduce(torch.tensor([float(rank)]), comm=half)
    checks.check(got.item() == float(sum(members)),
                 f"split comm: {got.item()} != {sum(members)}")
    got = fastreduce.allreduce(torch.tensor([2.0 * rank]), "avg", comm=half)
    checks.check(got.item() == 2.0 * sum(members) / len(members),
                 "avg divides by the comm's size")
    half.Free()


def test_cartesian_communicator(checks, comm):
    cart = comm.Create_cart([comm.size], periods=[False])
    checks.check(fastreduce.allreduce(torch.ones(2), comm=cart).tolist() == [comm.size] * 2,
                 "cartcomm")
    cart.Free()


@pytest.mark.parametrize("mpi_op, name", [pytest.param(o, n, id=n) for o, n in MPI_OPS])
def test_mpi_op(mpi_op, name, checks, comm):
    """mpi4py's predefined op gives what the op's name gives."""
    rank = comm.rank
    i = torch.tensor([rank + 1, 1 << rank % 8, rank], dtype=torch.int64)
    checks.check(torch.equal(fastreduce.allreduce(i, mpi_op), fastreduce.allreduce(i, name)),
                 f"MPI op {name}")


def test_op_name_in_any_case(checks, comm):
    rank = comm.rank
    i = torch.tensor([rank + 1, 1 << rank % 8, rank], dtype=torch.int64)
    checks.check(torch.equal(fastreduce.allreduce(i, "SUM"), fastreduce.allreduce(i, "sum")),
                 "SUM")


@pytest.mark.parametrize("mpi_op, name", [pytest.param(o, n, id=n) for o, n in LOGICAL_OPS])
def test_logical_op(mpi_op, name, checks, comm):
    """MPI's logical ops on bool tensors give the bitwise ops' results."""
    flags = torch.tensor([comm.rank == 0, True, False])
    checks.check(torch.equal(fastreduce.allreduce(flags, mpi_op),
                             fastreduce.allreduce(flags, name)), f"logical {name}")


@pytest.mark.skipif(fastreduce.build_mpi()[0] != "MPICH",
                    reason="stale-handle MPI error check skipped: needs MPICH's handle checking")
def test_error_mpi_detects(checks, comm):
    """An error MPI itself detects comes back as mpi4py.MPI.Exception, and nothing is
    written: a handle to a communicator freed behind mpi4py's back. MPICH checks
    handles and returns MPI_ERR_COMM; Open MPI's handles are pointers, so the same
    call there is a use after free: only MPICH runs this case."""
    stale_owner = comm.Dup()
    stale = MPI.Comm.f2py(stale_owner.py2f())
    stale_owner.Free()
    y = np.arange(3.0)
    try:
        fastreduce.allreduce_(y, comm=stale)
    except MPI.Exception as exc:
        checks.check(exc.Get_error_class() != MPI.SUCCESS, "error class")
    except Exception as exc:  # noqa: BLE001
        checks.check(False, f"stale communicator raised {exc!r}, not MPI.Exception")
    else:
        checks.check(False, "a freed communicator's stale handle was accepted")
    checks.check(np.array_equal(y, np.arange(3.0)), "rejected call wrote into its buffer")
