"""Set-up and queries: init, shutdown, rank, size, local and cross ranks, what is built."""

from __future__ import annotations

import atexit
import sys

from mpi4py import MPI

from ... import settings, watchdog
from . import handles, negotiation, timeline, world
from . import process_sets as _process_sets
from .world import _the_world


def _ranks_comm(ranks, parent: MPI.Intracomm) -> MPI.Intracomm:
    """A communicator of the given ranks of parent, in that order (collective over parent)."""
    ranks = [int(r) for r in ranks]
    if sorted(set(ranks)) != sorted(ranks) or any(not 0 <= r < parent.Get_size()
                                                  for r in ranks):
        raise ValueError(f"fastreduce.horovod.init: comm={ranks} must be distinct ranks of "
                         f"the {parent.Get_size()} MPI ranks")
    me = parent.Get_rank()
    color = 0 if me in ranks else MPI.UNDEFINED
    key = ranks.index(me) if me in ranks else 0
    return parent.Split(color, key)


def init(comm=None, process_sets=None) -> None:
    """Start Horovod over MPI: comm is an mpi4py communicator or a list of COMM_WORLD ranks
    (default: all of COMM_WORLD); process_sets a list of ProcessSet, or "dynamic"."""
    if world.current is not None:
        return  # as Horovod: a second init() is a no-op
    if comm is None:
        comm = MPI.COMM_WORLD.Dup()
    elif isinstance(comm, MPI.Intracomm):
        comm = comm.Dup()
    elif isinstance(comm, (list, tuple, range)):
        comm = _ranks_comm(comm, MPI.COMM_WORLD)
        if comm == MPI.COMM_NULL:
            return  # this rank is not in the Horovod world
    else:
        raise TypeError(f"fastreduce.horovod.init: comm must be an mpi4py Intracomm or a list "
                        f"of ranks, not {type(comm).__qualname__}")
    made = world.World(comm)
    try:
        _process_sets._start(made.comm, process_sets)
    except BaseException:
        made.free()
        raise
    world.current = made
    global _exit_registered
    if not _exit_registered:
        atexit.register(_shutdown_at_exit)
        sys.excepthook = _noting_crash(sys.excepthook)
        _exit_registered = True
    path = settings.value("HOROVOD_TIMELINE")
    if path:
        timeline.start_timeline(path, mark_cycles=settings.value("HOROVOD_TIMELINE_MARK_CYCLES"))


def shutdown() -> None:
    """End Horovod: pending operations are completed, ranks still in a collective on one of
    this rank's process sets told (they raise HorovodInternalError), process sets and
    communicators freed. Collective: it returns once every other rank of each set has
    shut down too or reached a collective there."""
    if world.current is None:
        return
    handles._finish_all()
    members = _process_sets._members()
    for ps in members:
        handles._finish_all(ps.comm)
    negotiation.leave([ps.comm for ps in members])
    timeline.stop_timeline()
    _process_sets._stop()
    negotiation.forget_gone()
    world.current.free()
    world.current = None


_exit_registered = False
_crashed = False


def _noting_crash(previous):
    def hook(*exc_info):
        global _crashed
        _crashed = True
        previous(*exc_info)
    return hook


def _shutdown_at_exit() -> None:
    # as Horovod's, at the end of the program. Not after an uncaught exception: the other
    # ranks may be where no exchange reaches them, and MPI_Finalize (at exit) would wait
    # for them for ever; the job is ended instead, as `python -m mpi4py` ends it
    if world.current is None:
        return
    if _crashed and MPI.COMM_WORLD.Get_size() > 1:
        watchdog.end_job()
    if not _crashed:
        shutdown()


def is_initialized() -> bool:
    """Whether init() has run (and shutdown() has not)."""
    return world.current is not None


def rank() -> int:
    """This process's rank in the Horovod world."""
    return _the_world().rank


def size() -> int:
    """How many processes the Horovod world has."""
    return _the_world().size


def local_rank() -> int:
    """This process's rank among those on its node."""
    return _the_world().local.Get_rank()


def local_size() -> int:
    """How many processes of the world share this node."""
    return _the_world().local.Get_size()


def cross_rank() -> int:
    """This node's index among the nodes (the rank among processes of the same local rank)."""
    return _the_world().cross.Get_rank()


def cross_size() -> int:
    """How many nodes have a process of this local rank."""
    return _the_world().cross.Get_size()


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes."""
    return _the_world().homogeneous


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE."""
    _the_world()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True: every operation runs over MPI."""
    return True


def mpi_built() -> bool:
    """True: fastreduce is built against MPI."""
    return True


def gloo_enabled() -> bool:
    """False: there is no gloo controller."""
    return False


def gloo_built() -> bool:
    """False: there is no gloo controller."""
    return False


def nccl_built() -> bool:
    """False: GPU tensors go through MPI (CUDA-aware or staged), never NCCL."""
    return False


def ddl_built() -> bool:
    """False."""
    return False


def ccl_built() -> bool:
    """False."""
    return False


def mlsl_built() -> bool:
    """False."""
    return False


def cuda_built() -> bool:
    """Whether the installed torch was built with CUDA (fastreduce's GPU paths use it)."""
    import torch

    return torch.version.cuda is not None


def rocm_built() -> bool:
    """False: ROCm is not supported."""
    return False
