"""Horovod's timeline: a Chrome trace (chrome://tracing, Perfetto) of rank 0's
collectives, each with its negotiation (the ranks' agreement) and its run, one row per
tensor name; DistributedOptimizer adds its buckets' phases (fastreduce.torch.buckets).
HOROVOD_TIMELINE=path at init(), or start_timeline()/stop_timeline()."""

from __future__ import annotations

from ...timeline import Trace, now_us
from .world import _the_world

_trace: Trace | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Rank 0 writes the timeline of its operations to file_path (a JSON array), as
    Horovod's coordinator does; the other ranks write nothing."""
    global _trace
    if _the_world().rank != 0:
        return
    stop_timeline()
    _trace = Trace(file_path)


def stop_timeline() -> None:
    """Close the timeline file (a valid JSON array from here on)."""
    global _trace
    trace, _trace = _trace, None
    if trace is not None:
        trace.close()


def current() -> Trace | None:
    """The trace being written, or None."""
    return _trace


def begin(kind: str, name: str, negotiation_start: float | None):
    """The record of an operation that starts now (after a negotiation that started at
    negotiation_start, a now() value); None when no timeline is written."""
    trace = _trace
    if trace is None:
        return None
    start = now_us()
    if negotiation_start is not None:
        trace.complete(f"NEGOTIATE_{kind.upper()}", "negotiation", name, negotiation_start,
                       start)
    return (trace, kind, name, start)


def end(event) -> None:
    """The operation of `event` (from begin) has completed."""
    if event is None:
        return
    trace, kind, name, start = event
    trace.complete(kind.upper(), kind, name, start, now_us())
    trace.flush()


def now() -> float | None:
    """A start time for begin(), or None when no timeline is written (costs nothing)."""
    return None if _trace is None else now_us()
