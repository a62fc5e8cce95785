"""Handles of asynchronous operations: poll() and synchronize() as Horovod's."""

from __future__ import annotations

from collections.abc import Callable

from . import timeline


class _Pending:
    __slots__ = ("requests", "finish", "key", "event")

    def __init__(self, requests: list, finish: Callable[[], object], key, event):
        self.requests = requests  # fastreduce Requests (the progress engine's or MPI's)
        self.finish = finish      # makes the result once the requests are complete
        self.key = key            # (process set id, name): in flight until synchronized
        self.event = event        # the timeline's record of the operation


_pending: dict[int, _Pending] = {}
_in_flight: set = set()
_next = 0


def start(requests: list, finish: Callable[[], object], key, event) -> int:
    """A new handle for an operation whose requests have started."""
    global _next
    _next += 1
    _pending[_next] = _Pending(requests, finish, key, event)
    _in_flight.add(key)
    return _next


def in_flight(key) -> bool:
    """Whether an operation of this process set and name awaits synchronize()."""
    return key in _in_flight


def requests(handle: int) -> list:
    """The requests of a pending handle's operation."""
    return _pending[handle].requests


def poll(handle: int) -> bool:
    """Whether the operation of `handle` has completed (synchronize() will not block)."""
    pending = _pending.get(handle)
    if pending is None:
        raise ValueError(f"fastreduce.horovod: poll: handle {handle!r} is not pending (never "
                         f"made, or synchronized already)")
    return all(r.test() for r in pending.requests)


def synchronize(handle: int):
    """Wait for the operation of `handle` and return its result."""
    pending = _pending.pop(handle, None)
    if pending is None:
        raise ValueError(f"fastreduce.horovod: synchronize: handle {handle!r} is not pending "
                         f"(never made, or synchronized already)")
    _in_flight.discard(pending.key)
    try:
        for r in pending.requests:
            r.wait()
        return pending.finish()
    finally:
        timeline.end(pending.event)


def _finish_all() -> None:
    for handle in list(_pending):
        synchronize(handle)
