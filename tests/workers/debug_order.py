"""FASTREDUCE_DEBUG=1: ranks that call all-reduces on two communicators in different orders
(a deadlock in MPI) all raise the same CollectiveMismatch instead of waiting forever."""

from __future__ import annotations

import faulthandler
import time

import torch
from common import WORLD, Failures
from mpi4py import MPI

import fastreduce
from fastreduce import CollectiveMismatch

f = Failures()
faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, before the timeout
p, rank = WORLD.size, WORLD.rank
fastreduce.set_debug(True, report_after=1.0)

# two communicators with the same members, told apart only by name
first = fastreduce.Partition(WORLD.Dup())
second = fastreduce.Partition(WORLD.Dup())
first.comm.Set_name("first")
second.comm.Set_name("second")

# matching orders work, however late a rank is
x = torch.ones(4)
if rank == 0:
    time.sleep(2.5)  # longer than report_after: the others report, then this rank arrives
fastreduce.allreduce_(x, comm=first.comm)
fastreduce.allreduce_(x, comm=second.comm)
f.check(torch.equal(x, torch.full((4,), float(p * p))), f"matching order gave {x}")

# a chain that resolves: rank 0 waits on {0, 1}, rank 1 first on {1, 2}, rank 2 is late
if p >= 3:
    pair = WORLD.Split(0 if rank < 2 else MPI.UNDEFINED)
    later = WORLD.Split(0 if rank in (1, 2) else MPI.UNDEFINED)
    y = torch.ones(2)
    if rank == 2:
        time.sleep(2.5)
    if rank in (1, 2):
        fastreduce.allreduce_(y, comm=later)
    if rank < 2:
        fastreduce.allreduce_(y, comm=pair)
    expected = {0: 3.0, 1: 3.0, 2: 2.0}.get(rank, 1.0)
    f.check(torch.equal(y, torch.full((2,), expected)), f"the chain gave {y}")

started = time.monotonic()
order = [second, first] if rank == 0 else [first, second]
try:
    for part in order:
        fastreduce.allreduce_(torch.ones(4), comm=part.comm)
except CollectiveMismatch as exc:
    outcome = str(exc)
    if rank == 0:
        print(outcome, flush=True)
    for words in ("rank 0 waits in allreduce_", "'second'", "'first'", "in the same order"):
        f.check(words in outcome, f"the message lacks {words!r}: {outcome}")
except Exception as exc:  # noqa: BLE001
    outcome = f"other: {exc!r}"
else:
    outcome = "nothing raised"
elapsed = time.monotonic() - started
f.check(elapsed < 20, f"the deadlock took {elapsed:.1f} s to be seen")
outcomes = WORLD.allgather(outcome)
f.check(outcomes[0].startswith("fastreduce: collectives that can never complete"),
        f"rank 0: {outcomes[0]}")
f.check(len(set(outcomes)) == 1, f"the ranks raised different things: {outcomes}")

# the program goes on (on other communicators): a rank that raised is not taken for waiting
third = WORLD.Dup()
z = torch.ones(3)
if rank == 0:
    time.sleep(2.5)  # the others report waiting; rank 0 must not look stuck in 'second'
try:
    fastreduce.allreduce_(z, comm=third)
except CollectiveMismatch as exc:
    f.check(False, f"a late rank after a raised deadlock was taken for a deadlock: {exc}")
f.check(torch.equal(z, torch.full((3,), float(p))), f"after the deadlock: {z}")
if rank == 0:
    print(f"different orders on two communicators: seen in {elapsed:.1f} s", flush=True)
f.finish()
