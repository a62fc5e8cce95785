"""The Horovod world: an MPI communicator (COMM_WORLD unless init() is given one), with
the node-local communicator from MPI_Comm_split_type(SHARED) and the cross-node one from
splitting the world by local rank, made once at init()."""

from __future__ import annotations

import re

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
        # the next number of an unnamed call ("allreduce.noname.3"), by (process set's
        # communicator handle, kind): new with each init()
        self.unnamed: dict[tuple[int, str], int] = {}

    def free(self) -> None:
        for c in (self.cross, self.local, self.comm):
            if c != MPI.COMM_NULL:
                c.Free()




current: World | None = None
# an unnamed call's name (kind, number), with a grouped or sparse call's part after it
_UNNAMED = re.compile(r"^(.*?)\.noname\.(\d+)(?:\.|$)")


def next_number(kind: str, where: int) -> int:
    """The number of the next unnamed call of this kind on the process set whose
    communicator's handle is `where` (0 before init(), whose calls are refused)."""
    if current is None:
        return 0
    number = current.unnamed.get((where, kind), 0)
    current.unnamed[where, kind] = number + 1
    return number


def unnamed_number(name: str) -> tuple[str | None, int]:
    """(kind, number) of an unnamed call's name; (None, 0) for a name given by the user."""
    found = _UNNAMED.match(name)
    return (found[1], int(found[2])) if found else (None, 0)


def numbering(where: int) -> dict[str, int]:
    """The next number of each kind of unnamed call on the set of `where`."""
    if current is None:
        return {}
    return {kind: n for (w, kind), n in current.unnamed.items() if w == where}


def follow_numbering(where: int, numbers: dict[str, int]) -> None:
    """Number the next unnamed calls of each kind on the set of `where` from at least
    numbers[kind] (after calls that other ranks made and this one did not)."""
    if current is not None:
        for kind, number in numbers.items():
            current.unnamed[where, kind] = max(current.unnamed.get((where, kind), 0), number)


def forget_numbering(where: int) -> None:
    """The set of `where` is removed (its handle may come again for another set)."""
    if current is not None:
        for key in [k for k in current.unnamed if k[0] == where]:
            del current.unnamed[key]


def _the_world() -> World:
    """The world init() made; ValueError before init()."""
    if current is None:
        raise ValueError("fastreduce.horovod has not been initialized; call hvd.init() first")
    return current
