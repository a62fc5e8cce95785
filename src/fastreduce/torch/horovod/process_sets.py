"""Process sets: subsets of the Horovod world that run collectives among themselves, each
over an MPI communicator made once when the set is registered and kept until removed."""

from __future__ import annotations

from mpi4py import MPI

from ... import checks, settings
from .negotiation import agree_call, forget, settle_poll
from .world import _the_world


class ProcessSet:
    """A set of Horovod ranks (a list of ranks, or an mpi4py communicator whose ranks are
    mapped to the world's); registered by init(process_sets=...) or add_process_set()."""

    def __init__(self, ranks_or_comm):
        self.process_set_id: int | None = None
        self.comm: MPI.Intracomm | None = None  # this rank's communicator, if included
        self._given_comm = None
        if isinstance(ranks_or_comm, MPI.Comm):
            self._given_comm = ranks_or_comm
            self.ranks: list[int] | None = None  # known once registered
        else:
            try:
                self.ranks = sorted(int(r) for r in ranks_or_comm)
            except TypeError:
                raise TypeError(f"fastreduce.horovod: ProcessSet takes a list of ranks or an "
                                f"mpi4py communicator, not {type(ranks_or_comm).__qualname__}"
                                ) from None

    def size(self) -> int:
        """How many ranks the set has."""
        return len(self._registered().ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 if not included)."""
        ranks = self._registered().ranks
        me = _the_world().rank
        return ranks.index(me) if me in ranks else -1

    def included(self) -> bool:
        """Whether this process belongs to the set."""
        return _the_world().rank in self._registered().ranks

    def _registered(self) -> ProcessSet:
        if self.process_set_id is None or self.ranks is None:
            raise ValueError(f"fastreduce.horovod: {self!r} is not registered; pass it to "
                             f"hvd.init(process_sets=[...]) or hvd.add_process_set()")
        return self

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
_sets: dict[int, ProcessSet] = {}
_dynamic = False
_next_id = 1


def _start(world: MPI.Intracomm, process_sets) -> None:
    """init()'s part: the global set over the world, then the static sets."""
    global _dynamic, _next_id
    global_process_set.ranks = list(range(world.Get_size()))
    global_process_set.comm = world
    global_process_set.process_set_id = 0
    _sets.clear()
    _sets[0] = global_process_set
    _next_id = 1
    _dynamic = process_sets == "dynamic" or settings.value("HOROVOD_DYNAMIC_PROCESS_SETS")
    if process_sets in (None, "dynamic"):
        listed = process_sets
    else:
        process_sets = list(process_sets)
        listed = f"{len(process_sets)} process sets"
    checks.agree(world, "hvd.init", {"process_sets": listed})
    if process_sets in (None, "dynamic"):
        return
    for ps in process_sets:
        _register(ps, world)


def _members() -> list[ProcessSet]:
    """The sets this rank belongs to, by id (the same order on every rank)."""
    return [_sets[i] for i in sorted(_sets) if _sets[i].comm is not None]


def _stop() -> None:
    for ps in list(_sets.values()):
        if ps is not global_process_set and ps.comm is not None:
            ps.comm.Free()
        ps.comm = None
        ps.process_set_id = None
    _sets.clear()
    global_process_set.ranks = []


def _register(ps, world: MPI.Intracomm) -> ProcessSet:
    """Collective over the world: agree on the set's ranks, make its communicator."""
    global _next_id
    if not isinstance(ps, ProcessSet):
        ps = ProcessSet(ps)
    error = None
    if ps._given_comm is not None:
        agree_call(world, "hvd.add_process_set", {"from": "a communicator"})
        mine = world.Get_rank() if ps._given_comm != MPI.COMM_NULL else -1
        members = [r for r in world.allgather(mine) if r >= 0]
        ps.ranks = members
    ranks = ps.ranks
    if ps.process_set_id is not None:
        error = ValueError(f"fastreduce.horovod: {ps!r} is registered already")
    elif not ranks or len(set(ranks)) != len(ranks) or \
            any(not 0 <= r < world.Get_size() for r in ranks):
        error = ValueError(f"fastreduce.horovod: a process set needs distinct ranks in "
                           f"0..{world.Get_size() - 1}, not {ranks}")
    elif any(other.ranks == ranks for other in _sets.values()):
        error = ValueError(f"fastreduce.horovod: a process set of ranks {ranks} exists "
                           f"already; use that one")
    agree_call(world, "hvd.add_process_set", {"ranks": ranks}, error)
    me = world.Get_rank()
    comm = world.Split(0 if me in ranks else MPI.UNDEFINED, key=me)
    ps.comm = None if comm == MPI.COMM_NULL else comm
    ps.process_set_id = _next_id
    _next_id += 1
    _sets[ps.process_set_id] = ps
    return ps


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks) on every rank (collective;
    needs dynamic process sets: HOROVOD_DYNAMIC_PROCESS_SETS=1 or init(process_sets=
    "dynamic"))."""
    world = _the_world().comm
    if not _dynamic:
        raise ValueError("fastreduce.horovod: add_process_set needs dynamic process sets: set "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 or call hvd.init(process_sets="
                         "'dynamic'), or pass the sets to hvd.init(process_sets=[...])")
    return _register(process_set, world)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (collective); False if it was not registered."""
    world = _the_world().comm
    if not _dynamic:
        raise ValueError("fastreduce.horovod: remove_process_set needs dynamic process sets "
                         "(HOROVOD_DYNAMIC_PROCESS_SETS=1 or hvd.init(process_sets='dynamic'))")
    if process_set is global_process_set:
        raise ValueError("fastreduce.horovod: the global process set cannot be removed")
    known = process_set.process_set_id in _sets
    if process_set.comm is not None:  # the set's last round settled before it goes
        settle_poll(process_set.comm)
    agree_call(world, "hvd.remove_process_set", {"process set": process_set.process_set_id})
    if not known:
        return False
    del _sets[process_set.process_set_id]
    if process_set.comm is not None:
        forget(process_set.comm)
        process_set.comm.Free()
    process_set.comm = None
    process_set.process_set_id = None
    return True


def _comm_of(ps: ProcessSet, what: str) -> MPI.Intracomm:
    """The set's communicator on this rank; ValueError if unregistered or not a member."""
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"fastreduce.horovod: {what}: process_set must be a ProcessSet, not "
                        f"{type(ps).__qualname__}")
    ps._registered()
    if ps.comm is None:
        raise ValueError(f"fastreduce.horovod: {what}: rank {_the_world().rank} is not in the "
                         f"process set {ps!r}; only its ranks may call collectives on it")
    return ps.comm
