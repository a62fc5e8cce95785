"""A file whose cases differ by rank: the ranks must refuse to run it."""

from mpi4py import MPI

if MPI.COMM_WORLD.rank == 0:
    def test_only_on_rank_0():
        pass


def test_everywhere():
    pass
