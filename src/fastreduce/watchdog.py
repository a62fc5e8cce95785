"""A timeout for collectives that never complete, and the flight record that explains them.

By default (as torch.distributed bounds its collectives), a collective waited for longer
than DEFAULT_TIMEOUT seconds (10 minutes) ends the job: the rank prints its flight record,
the stuck call marked, on stderr and ends the job with MPI_Abort, so a hang does not burn
the allocation (2 s after printing, so that the other ranks stuck in the same call print
theirs; a rank whose MPI_Abort cannot reach its launcher, as when its node's link is down,
exits by itself 10 s later). FASTREDUCE_TIMEOUT=seconds (or set_timeout(seconds)) sets
another bound, FASTREDUCE_TIMEOUT=0 (or set_timeout(None)) none. The record holds the
last FASTREDUCE_FLIGHT_RECORD calls (default 64), kept in C by the compiled core at a few
stores and a clock read a call; `flight_record()` returns it at any time.

A communicator may carry a bound of its own (`bound_communicator`: a torch.distributed
group's timeout): a call on it waited for longer than the sooner of the two ends the job
the same way, naming the bound. It ends the job rather than raise: MPI cannot cancel a
collective in flight, and a rank that left one would leave MPI writing into its buffers.

A request that is started and not yet waited for is never "stuck": overlapping it with
long computation is its purpose. A signal handler (SIGUSR1) cannot print the record of a
hung rank: Python runs handlers only between bytecodes, and a rank stuck inside MPI runs
none; the watchdog thread is the way.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

from mpi4py import MPI

from . import settings
from .backend import collectives

__all__ = ["DEFAULT_TIMEOUT", "bound_communicator", "flight_record", "format_record", "recorded",
           "set_timeout", "timeout"]

DEFAULT_TIMEOUT = 600.0  # seconds: torch.distributed's default bound on a collective
_timeout: float | None = None
_size = 64
_thread: threading.Thread | None = None
# Reentrant: a process group the garbage collector takes while this thread holds it removes
# its bound from inside (weakref.finalize).
_lock = threading.RLock()
# comm_bound_key(comm): (seconds, what set it, the token of that setting); the compiled
# core's table (set_comm_bound) is what counts: a freed communicator's bound no longer does
_bounds: dict[int, tuple[float, str, object]] = {}
_poll = 1.0  # seconds between the watchdog's looks (_period(), kept as the bounds change)
_FIELDS = ("number", "call", "comm", "count", "dtype", "started", "waiting_since", "state")


def _comm_name(comm) -> str:
    if comm is None:
        return "default communicator"
    try:  # the record keeps the object it was given: its handle may have been freed since
        if not collectives.comm_is_live(comm):
            return "communicator (freed)"
        return f"{comm.Get_name() or 'communicator'} (size {comm.Get_size()})"
    except MPI.Exception:
        return "communicator"


@contextlib.contextmanager
def recorded(call: str, comm=None):
    """Record a set-up collective (a communicator made, settings agreed, a calibration)
    while it runs, when a timeout is set: a rank that never arrives is seen there too."""
    entry = collectives.flight_begin(call, comm, 0, "set-up")
    if entry is None:
        yield
        return
    try:
        yield
    except BaseException:
        collectives.flight_end(entry, False)
        raise
    collectives.flight_end(entry)


def flight_record() -> list[dict]:
    """This rank's last collectives, oldest first: number, call, comm, count, dtype, started
    (time.time()), waiting_since, state ("in MPI", "started", "waiting", "done", "failed")."""
    return [dict(zip(_FIELDS, (number, call, _comm_name(comm), *rest), strict=True))
            for number, call, comm, *rest in collectives.flight_entries()]


def format_record(stuck: int | None = None) -> str:
    """The flight record as text, the stuck entry (its number) marked."""
    now = time.time()
    rank = MPI.COMM_WORLD.Get_rank()
    entries = flight_record()
    lines = [f"fastreduce flight record, rank {rank} (last {len(entries)} collectives, "
             f"oldest first):"]
    width = max([22, *(len(e["call"]) for e in entries)])
    for e in entries:
        mark = ">>" if e["number"] == stuck else "  "
        age = f"{now - e['started']:8.2f} s ago"
        lines.append(f"{mark} #{e['number']:<6} {e['call']:{width}s} {e['comm']:34s} count "
                     f"{e['count']:<10} {e['dtype']:9s} started {age}  {e['state']}")
    return "\n".join(lines)


def timeout() -> float | None:
    """The timeout in seconds, or None (off)."""
    return _timeout


def set_timeout(seconds: float | None) -> None:
    """End the job when a collective is stuck longer than `seconds` (None: never; the
    default is FASTREDUCE_TIMEOUT's, else DEFAULT_TIMEOUT). Every rank should use the same."""
    global _timeout
    if seconds is not None:
        seconds = float(seconds)
        if not 0 < seconds <= settings.MAX_SECONDS:
            raise ValueError(f"fastreduce: timeout {seconds}: give seconds > 0, or None")
    _timeout = seconds
    _watch_while_bounded()


def bound_communicator(comm, seconds: float | None,
                       source: str = "its own bound") -> Callable[[], None]:
    """End the job also when a collective on comm is waited for longer than `seconds` (the
    sooner of this and timeout() applies, even with timeout() off); None removes the
    bound. `source` names it in the message. Every rank of comm should give the same.
    Returns what removes the bound; once comm is freed (comm.Free()) the bound no longer
    counts (a later communicator that MPI gives the same handle starts unbounded)."""
    if seconds is not None and not 0 < float(seconds) <= settings.MAX_SECONDS:
        raise ValueError(f"fastreduce: bound of {seconds} s on a communicator: give seconds "
                         f"> 0, or None")
    key = collectives.comm_bound_key(comm)
    if seconds is None:
        with _lock:
            held = _bounds.get(key)
            if held is not None:
                _forget_bound(key, held[2])
        return lambda: None
    token = object()  # this setting: a remover of an earlier one leaves it in place
    with _lock:
        collectives.set_comm_bound(comm, float(seconds))
        _bounds[key] = (float(seconds), source, token)
    _watch_while_bounded()
    return lambda: _forget_bound(key, token)


def _forget_bound(key: int, token: object) -> None:
    # the record stays as it is: another thread may be recording a call into it
    global _poll
    with _lock:
        held = _bounds.get(key)
        if held is None or held[2] is not token:
            return  # removed already, or another setting since
        collectives.clear_comm_bound(key)
        del _bounds[key]
        _poll = _period()


def _watch_while_bounded() -> None:
    """The flight record kept, and the watchdog running, while any bound is set."""
    global _thread, _poll
    bounded = _timeout is not None or bool(_bounds)
    collectives.set_flight_record(_size if bounded else 0, recorded if bounded else None)
    with _lock:
        _poll = _period()
        if bounded and _thread is None:
            _thread = threading.Thread(target=_watch, name="fastreduce-watchdog", daemon=True)
            _thread.start()


def _period() -> float:
    """Seconds between the watchdog's looks: a quarter of the shortest bound, at most 1."""
    # (a copy: a finalizer the collector runs meanwhile may remove a bound)
    limits = [held[0] for held in list(_bounds.values())] + ([_timeout] if _timeout else [])
    return min([1.0, *(b / 4 for b in limits)])


def _bound_of(number: int) -> tuple[float, str]:
    """(seconds, what set it) of the bound that call `number` went past."""
    limit, source = _timeout, "FASTREDUCE_TIMEOUT"
    for entry, _, comm, *_ in collectives.flight_entries():
        if entry == number and comm is not None and collectives.comm_is_live(comm):
            own = collectives.comm_bound_seconds(comm)  # 0.0: none that counts
            if own and (limit is None or own < limit):
                held = _bounds.get(collectives.comm_bound_key(comm))
                limit, source = own, held[1] if held else "its own bound"
    return limit, source


def _watch() -> None:
    # allocates nothing while nothing is stuck (the look at the record is in C)
    while True:
        time.sleep(_poll)
        timeout = _timeout  # (read once: set_timeout may change it meanwhile)
        stuck = collectives.flight_stuck(timeout or 0.0) if timeout or _bounds else None
        if stuck is None:
            continue
        limit, source = _bound_of(stuck)
        rank = MPI.COMM_WORLD.Get_rank()
        entry = next((e for e in flight_record() if e["number"] == stuck), None)
        what = f"{entry['call']} #{stuck} on {entry['comm']}" if entry else f"call #{stuck}"
        _say(f"fastreduce: rank {rank}: {what} has not completed in {limit:g} s "
             f"({source}); aborting the job\n{format_record(stuck)}")
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
    """FASTREDUCE_FLIGHT_RECORD and FASTREDUCE_TIMEOUT (unset: DEFAULT_TIMEOUT; 0: none)."""
    global _size
    size = settings.value("FASTREDUCE_FLIGHT_RECORD")
    if size is not None:
        _size = size
    set_timeout(settings.value("FASTREDUCE_TIMEOUT"))
