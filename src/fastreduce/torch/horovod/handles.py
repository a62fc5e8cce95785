"""Handles of asynchronous operations: poll() and synchronize() as Horovod's. A handle is
made when its request is submitted; until every rank has submitted it (negotiation.py) it
is pending without requests, and synchronize() takes part in the ranks' rounds until it
runs."""

from __future__ import annotations

from collections.abc import Callable

from . import negotiation, timeline


class _Pending:
    __slots__ = ("requests", "finish", "key", "event", "submitted", "first_only", "started")

    def __init__(self, requests: list | None, finish: Callable[[], object] | None, key, event):
        self.requests = requests  # fastreduce Requests (the progress engine's or MPI's)
        self.finish = finish      # makes the result once the requests are complete
        self.key = key            # (process set id, name): in flight until done
        self.event = event        # the timeline's record of the operation
        self.submitted = None     # (comm, negotiation.Request) until the ranks have run it
        self.first_only = False   # the result is the first of finish()'s list
        self.started = negotiation.rounds()  # the rounds this rank had taken part in then


_pending: dict[int, _Pending] = {}
_in_flight: dict = {}  # key -> the handle of the operation of that name not known to be done
_next = 0


def _new(pending: _Pending) -> int:
    global _next
    _next += 1
    _pending[_next] = pending
    _in_flight[pending.key] = _next
    return _next


def start(requests: list, finish: Callable[[], object], key, event) -> int:
    """A new handle for an operation whose requests have started."""
    return _new(_Pending(requests, finish, key, event))


def reserve(key) -> int:
    """A new handle for an operation submitted but not started: adopt() gives it its
    operation, submitted() what it waits for until then."""
    return _new(_Pending(None, None, key, None))


def submitted(handle: int, comm, request) -> None:
    """The negotiation request of a reserved handle, for synchronize() to wait on."""
    pending = _pending.get(handle)
    if pending is not None and pending.requests is None:
        pending.submitted = (comm, request)


def adopt(handle: int, started: int) -> None:
    """The reserved handle takes over the operation of handle `started`."""
    inner = _pending.pop(started)
    pending = _pending[handle]
    pending.requests, pending.finish, pending.event = inner.requests, inner.finish, inner.event
    pending.submitted, pending.started = None, inner.started
    _in_flight[pending.key] = handle


def release(handle: int) -> None:
    """Forget a reserved handle whose submission was refused."""
    pending = _pending.pop(handle, None)
    if pending is not None:
        _forget(pending.key, handle)


def first_only(handle: int) -> int:
    """The handle, its result made the first (the only) output rather than a list."""
    _pending[handle].first_only = True
    return handle


def _forget(key, handle: int) -> None:
    if _in_flight.get(key) == handle:
        del _in_flight[key]


def in_flight(key) -> bool:
    """Whether an operation of this process set and name is in flight, as Horovod has it: not
    synchronized, and not seen complete (by poll(); or its requests complete and this rank
    has taken part in a round since it started: a name is free again at the next call
    after its operation completed, not while it runs)."""
    handle = _in_flight.get(key)
    if handle is None:
        return False
    pending = _pending.get(handle)
    if pending is None or (pending.requests is not None and
                           pending.started < negotiation.rounds() and
                           all(r.test() for r in pending.requests)):
        del _in_flight[key]
        return False
    return True


def _get(handle: int, what: str) -> _Pending:
    pending = _pending.get(handle)
    if pending is None:
        raise ValueError(f"fastreduce.horovod: {what}: handle {handle!r} is not pending (never "
                         f"made, or synchronized already)")
    return pending


def poll(handle: int) -> bool:
    """Whether the operation of `handle` has completed (synchronize() will not block)."""
    pending = _get(handle, "poll")
    if pending.requests is None and pending.submitted is not None:
        negotiation.progress(*pending.submitted)  # a round that does not wait
        if pending.requests is None:  # not yet submitted by every rank; or failed
            return pending.submitted[1].error is not None
    done = all(r.test() for r in pending.requests)
    if done:  # seen complete: its name is free again, as in Horovod
        _forget(pending.key, handle)
    return done


def _started(handle: int, pending: _Pending) -> _Pending:
    """The handle's operation once every rank has submitted it (rounds until then)."""
    if pending.requests is None and pending.submitted is not None:
        negotiation.wait(*pending.submitted)  # raises the request's error
    return _pending[handle]


def wait(handle: int) -> None:
    """Wait for the operation of `handle` to complete, leaving it pending."""
    for r in _started(handle, _get(handle, "wait")).requests:
        r.wait()


def synchronize(handle: int):
    """Wait for the operation of `handle` and return its result."""
    pending = _get(handle, "synchronize")
    try:
        pending = _started(handle, pending)
    except BaseException:
        release(handle)
        raise
    del _pending[handle]
    _forget(pending.key, handle)
    try:
        for r in pending.requests:
            r.wait()
        result = pending.finish()
        return result[0] if pending.first_only else result
    finally:
        timeline.end(pending.event)


def _finish_all(comm=None) -> None:
    """At shutdown: the operations never synchronized are completed, those started first
    (comm None), then those still to be matched on comm's set (shutdown() takes the sets
    in the order of their ids on every rank, then leaves them all at once, so that no rank
    waits on one set for a rank that waits on another). Their errors (a mismatch, ranks
    that shut down first) are dropped, as Horovod's shutdown drops them: no caller waits
    for them."""
    for handle, pending in list(_pending.items()):
        if (pending.submitted is None) if comm is None else \
                (pending.submitted is not None and pending.submitted[0] == comm):
            try:
                synchronize(handle)
            except Exception:  # noqa: BLE001, S110  (see above)
                pass
