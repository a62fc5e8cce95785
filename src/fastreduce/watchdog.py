"""A timeout for collectives that never complete, and the flight record that explains them.

With FASTREDUCE_TIMEOUT=seconds (or set_timeout(seconds)), fastreduce records its last
collectives (FASTREDUCE_FLIGHT_RECORD of them, default 64) and a watchdog thread checks
them: when one has been waited for longer than the timeout (a blocking call still in MPI,
or a request's wait()), the rank prints its flight record, the stuck call marked, on
stderr and ends the job with MPI_Abort, so a hang does not burn the allocation (2 s after
printing, so that the other ranks stuck in the same call print theirs; a rank whose
MPI_Abort cannot reach its launcher, as when its node's link is down, exits by itself 10 s
later).
`flight_record()` returns the record at any time. Off by default: recording costs about a
microsecond a call.

A request that is started and not yet waited for is never "stuck": overlapping it with
long computation is its purpose. A signal handler (SIGUSR1) cannot print the record of a
hung rank: Python runs handlers only between bytecodes, and a rank stuck inside MPI runs
none; the watchdog thread is the way.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import sys
import threading
import time

from mpi4py import MPI

from . import settings
from .backend import collectives

__all__ = ["flight_record", "format_record", "recorded", "set_timeout", "timeout"]

_timeout: float | None = None
_record: collections.deque = collections.deque(maxlen=64)
_numbers = itertools.count(1)
_thread: threading.Thread | None = None
_lock = threading.Lock()


class Entry:
    """One collective in the flight record."""

    __slots__ = ("number", "call", "comm", "count", "dtype", "started", "waiting_since",
                 "state")

    def __init__(self, call: str, comm, count: int, dtype: str, blocking: bool):
        self.number = next(_numbers)
        self.call = call
        self.comm = _comm_name(comm)
        self.count = count
        self.dtype = dtype
        self.started = time.time()
        self.waiting_since = self.started if blocking else None
        self.state = "in MPI" if blocking else "started"

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def _comm_name(comm) -> str:
    if comm is None:
        return "default communicator"
    try:
        return f"{comm.Get_name() or 'communicator'} (size {comm.Get_size()})"
    except MPI.Exception:
        return "communicator"


def begin(call: str, comm, count: int, dtype: str, blocking: bool = True) -> Entry:
    """Record a collective as it starts (blocking: in MPI now)."""
    entry = Entry(call, comm, count, dtype, blocking)
    _record.append(entry)
    return entry


@contextlib.contextmanager
def recorded(call: str, comm=None):
    """Record a set-up collective (a communicator made, settings agreed, a calibration)
    while it runs, when a timeout is set: a rank that never arrives is seen there too."""
    if _timeout is None:
        yield
        return
    entry = begin(call, comm, 0, "set-up")
    try:
        yield
    except BaseException:
        end(entry, False)
        raise
    end(entry)


def waiting(entry: Entry) -> None:
    """A request's wait() has begun: from now on it can be stuck."""
    if entry.state == "started":
        entry.waiting_since = time.time()
        entry.state = "waiting"


def end(entry: Entry, ok: bool = True) -> None:
    entry.state = "done" if ok else "failed"
    entry.waiting_since = None


def flight_record() -> list[dict]:
    """This rank's last collectives, oldest first: number, call, comm, count, dtype, started
    (time.time()), waiting_since, state ("in MPI", "started", "waiting", "done", "failed")."""
    return [e.as_dict() for e in list(_record)]


def format_record(stuck: Entry | None = None) -> str:
    """The flight record as text, the stuck entry marked."""
    now = time.time()
    rank = MPI.COMM_WORLD.Get_rank()
    lines = [f"fastreduce flight record, rank {rank} (last {len(_record)} collectives, "
             f"oldest first):"]
    entries = list(_record)
    width = max([22, *(len(e.call) for e in entries)])
    for e in entries:
        mark = ">>" if e is stuck else "  "
        age = f"{now - e.started:8.2f} s ago"
        lines.append(f"{mark} #{e.number:<6} {e.call:{width}s} {e.comm:34s} count {e.count:<10} "
                     f"{e.dtype:9s} started {age}  {e.state}")
    return "\n".join(lines)


def timeout() -> float | None:
    """The timeout in seconds, or None (off)."""
    return _timeout


def set_timeout(seconds: float | None) -> None:
    """Abort the job when a collective is stuck longer than `seconds` (None: off; the
    default comes from FASTREDUCE_TIMEOUT). Every rank should use the same setting."""
    global _timeout, _thread
    if seconds is not None:
        seconds = float(seconds)
        if not seconds > 0:
            raise ValueError(f"fastreduce: timeout {seconds}: give seconds > 0, or None")
    _timeout = seconds
    if seconds is None:
        collectives.set_flight_hooks(None, None, None)
    else:
        collectives.set_flight_hooks(begin, recorded, waiting)
    with _lock:
        if seconds is not None and _thread is None:
            _thread = threading.Thread(target=_watch, name="fastreduce-watchdog", daemon=True)
            _thread.start()


def _stuck() -> Entry | None:
    if _timeout is None:
        return None
    now = time.time()
    for e in list(_record):
        if e.waiting_since is not None and now - e.waiting_since > _timeout:
            return e
    return None


def _watch() -> None:
    while True:
        limit = _timeout
        time.sleep(min(1.0, limit / 4) if limit else 1.0)
        entry = _stuck()
        if entry is None:
            continue
        rank = MPI.COMM_WORLD.Get_rank()
        _say(f"fastreduce: rank {rank}: {entry.call} #{entry.number} on {entry.comm} has not "
             f"completed in {_timeout:g} s (FASTREDUCE_TIMEOUT); aborting the job\n"
             f"{format_record(entry)}")
        # The other ranks stuck in the same call time out within their polling period: give
        # them the time to print their record before this rank's MPI_Abort ends them.
        time.sleep(PRINT_GRACE)
        end_job()


def end_job() -> None:
    """End the whole job (MPI_Abort), where the others cannot be told by an exception: a
    rank stuck, or a rank leaving on an uncaught exception while the others may wait."""
    rank = MPI.COMM_WORLD.Get_rank()
    # MPI_Abort asks the launcher to end the job; where the launcher is out of reach
    # (this node's link is down) it may never return, and the rank would live on.
    backstop = threading.Timer(ABORT_GRACE, _exit_unaborted, (rank,))
    backstop.daemon = True
    backstop.start()
    MPI.COMM_WORLD.Abort(1)


PRINT_GRACE = 2.0  # seconds between printing the record and MPI_Abort
ABORT_GRACE = 10.0  # seconds MPI_Abort gets before the rank ends itself


def _say(text: str) -> None:
    """Print to stderr; a closed stderr (the launcher is gone) must not stop the abort."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _exit_unaborted(rank: int) -> None:
    try:  # no MPI call here: another thread is inside MPI_Abort
        _say(f"fastreduce: rank {rank}: MPI_Abort did not end this rank in {ABORT_GRACE:g} s "
             f"(the launcher is out of reach: a node or its link failed); exiting")
    finally:
        os._exit(1)


def _from_environment() -> None:
    global _record
    size = settings.value("FASTREDUCE_FLIGHT_RECORD")
    if size is not None:
        _record = collections.deque(maxlen=size)
    seconds = settings.value("FASTREDUCE_TIMEOUT")  # None: unset, blank or 0
    if seconds is not None:
        set_timeout(seconds)
