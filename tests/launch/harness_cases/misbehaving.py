"""One case that passes, one that fails on rank 1 only, one that hangs on rank 0."""

from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def test_passes(checks):
    checks.check(WORLD.allreduce(1) == WORLD.size, "allreduce of ones")


def test_fails_on_rank_1(checks):
    checks.check(WORLD.rank != 1, "rank 1 says no")
    WORLD.Barrier()  # the other ranks went on into a collective: they still finish it


def test_rank_0_waits_forever():
    if WORLD.rank == 0:
        WORLD.Barrier()  # the others never come


def test_after_the_hang():
    pass
