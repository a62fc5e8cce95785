"""The Horovod world: an MPI communicator (COMM_WORLD unless init() is given one), with
the node-local communicator from MPI_Comm_split_type(SHARED) and the cross-node one from
splitting the world by local rank, made once at init()."""

from __future__ import annotations

from mpi4py import MPI

from ... import watchdog


class World:
    """What init() made: the world communicator and the node and cross-node ones."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        with watchdog.recorded("fastreduce.horovod.init: node and cross-node communicators",
                               comm):
            self.local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            self.cross = comm.Split(self.local.Get_rank(), key=self.rank)
            sizes = comm.allgather(self.local.Get_size())
        self.homogeneous = len(set(sizes)) == 1

    def free(self) -> None:
        for c in (self.cross, self.local, self.comm):
            if c != MPI.COMM_NULL:
                c.Free()


current: World | None = None


def _the_world() -> World:
    """The world init() made; ValueError before init()."""
    if current is None:
        raise ValueError("fastreduce.horovod has not been initialized; call hvd.init() first")
    return current
