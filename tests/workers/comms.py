"""Communicators (default, world, split, self, Cartesian), MPI.Op arguments, MPI errors."""

from __future__ import annotations

import numpy as np
import torch
from common import WORLD, Failures
from mpi4py import MPI

import fastreduce

fails = Failures()
rank, size = WORLD.rank, WORLD.size

# The default communicator: a duplicate of COMM_WORLD, made once.
default = fastreduce.default_comm()
fails.check(default is fastreduce.default_comm(), "default_comm() made twice")
fails.check(MPI.Comm.Compare(default, WORLD) == MPI.CONGRUENT,
            "default communicator is not a duplicate of COMM_WORLD")
fails.check(default.Get_errhandler() == MPI.ERRORS_RETURN, "default comm errhandler")

# A message of the user's own on COMM_WORLD, sent before our collectives run,
# arrives untouched after them: our traffic is on another context.
if size > 1:
    peer = (rank + 1) % size
    request = WORLD.isend(("user", rank), dest=peer, tag=11)
    x = torch.full((5,), float(rank))
    fastreduce.allreduce_(x)
    got = WORLD.recv(source=(rank - 1) % size, tag=11)
    request.wait()
    fails.check(got == ("user", (rank - 1) % size), f"user message {got}")
    fails.check(torch.equal(x, torch.full((5,), float(sum(range(size))))), "sum beside user msg")

# comm=COMM_WORLD, COMM_SELF, a split communicator and a Cartesian one.
x = torch.arange(4, dtype=torch.float64) + rank
fails.check(torch.equal(fastreduce.allreduce(x, comm=WORLD),
                        size * torch.arange(4, dtype=torch.float64) + sum(range(size))), "world")
fails.check(torch.equal(fastreduce.allreduce(x, comm=MPI.COMM_SELF), x), "self")
color = rank % 2
half = WORLD.Split(color, rank)
members = [r for r in range(size) if r % 2 == color]
got = fastreduce.allreduce(torch.tensor([float(rank)]), comm=half)
fails.check(got.item() == float(sum(members)), f"split comm: {got.item()} != {sum(members)}")
got = fastreduce.allreduce(torch.tensor([2.0 * rank]), "avg", comm=half)
fails.check(got.item() == 2.0 * sum(members) / len(members), "avg divides by the comm's size")
half.Free()
cart = WORLD.Create_cart([size], periods=[False])
fails.check(fastreduce.allreduce(torch.ones(2), comm=cart).tolist() == [size] * 2, "cartcomm")
cart.Free()

# mpi4py's predefined ops, and op names in any case.
i = torch.tensor([rank + 1, 1 << rank % 8, rank], dtype=torch.int64)
pairs = [(MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MIN, "min"), (MPI.MAX, "max"),
         (MPI.BAND, "band"), (MPI.BOR, "bor"), (MPI.BXOR, "bxor")]
for mpi_op, name in pairs:
    fails.check(torch.equal(fastreduce.allreduce(i, mpi_op), fastreduce.allreduce(i, name)),
                f"MPI op {name}")
fails.check(torch.equal(fastreduce.allreduce(i, "SUM"), fastreduce.allreduce(i, "sum")), "SUM")
flags = torch.tensor([rank == 0, True, False])
for mpi_op, name in [(MPI.LAND, "band"), (MPI.LOR, "bor"), (MPI.LXOR, "bxor")]:
    fails.check(torch.equal(fastreduce.allreduce(flags, mpi_op),
                            fastreduce.allreduce(flags, name)), f"logical {name}")

# An error MPI itself detects comes back as mpi4py.MPI.Exception, and nothing is
# written: a handle to a communicator freed behind mpi4py's back. MPICH checks
# handles and returns MPI_ERR_COMM; Open MPI's handles are pointers, so the same
# call there is a use after free: only MPICH runs this check.
if fastreduce.build_mpi()[0] == "MPICH":
    check_stale_handle = True
else:
    check_stale_handle = False
    if rank == 0:
        print("stale-handle MPI error check skipped: needs MPICH's handle checking")
stale_owner = WORLD.Dup()
stale = MPI.Comm.f2py(stale_owner.py2f())
stale_owner.Free()
y = np.arange(3.0)
if check_stale_handle:
    try:
        fastreduce.allreduce_(y, comm=stale)
    except MPI.Exception as exc:
        fails.check(exc.Get_error_class() != MPI.SUCCESS, "error class")
    except Exception as exc:  # noqa: BLE001
        fails.check(False, f"stale communicator raised {exc!r}, not MPI.Exception")
    else:
        fails.check(False, "a freed communicator's stale handle was accepted")
    fails.check(np.array_equal(y, np.arange(3.0)), "rejected call wrote into its buffer")

fails.finish()
