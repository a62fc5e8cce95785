"""Horovod's timeline: a Chrome trace (chrome://tracing, Perfetto) of rank 0's
collectives, each with its negotiation (the ranks' agreement) and its run, one row per
tensor name. HOROVOD_TIMELINE=path at init(), or start_timeline()/stop_timeline()."""

from __future__ import annotations

import json
import os
import threading
import time

from .world import _the_world

_file = None
_lock = threading.Lock()
_first = True
_mark_cycles = False


def _now_us() -> float:
    return time.perf_counter_ns() / 1000.0


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Rank 0 writes the timeline of its operations to file_path (a JSON array), as
    Horovod's coordinator does; the other ranks write nothing."""
    global _file, _first, _mark_cycles
    if _the_world().rank != 0:
        return
    with _lock:
        if _file is not None:
            _file.close()
        directory = os.path.dirname(os.path.abspath(file_path))
        os.makedirs(directory, exist_ok=True)
        _file = open(file_path, "w")  # noqa: SIM115  (open until stop_timeline)
        _file.write("[\n")
        _first = True
        _mark_cycles = mark_cycles


def stop_timeline() -> None:
    """Close the timeline file (a valid JSON array from here on)."""
    global _file
    with _lock:
        if _file is None:
            return
        _file.write("\n]\n")
        _file.close()
        _file = None


def _write(event: dict) -> None:
    global _first
    with _lock:
        if _file is None:
            return
        _file.write(("" if _first else ",\n") + json.dumps(event))
        _first = False
        _file.flush()


def begin(kind: str, name: str, negotiation_start: float | None):
    """The record of an operation that starts now (after a negotiation that started at
    negotiation_start, a _now_us() value); None when no timeline is written."""
    if _file is None:
        return None
    start = _now_us()
    if negotiation_start is not None:
        _write({"name": f"NEGOTIATE_{kind.upper()}", "ph": "X", "ts": negotiation_start,
                "dur": start - negotiation_start, "pid": os.getpid(), "tid": name,
                "cat": "negotiation"})
    return (kind, name, start)


def end(event) -> None:
    """The operation of `event` (from begin) has completed."""
    if event is None or _file is None:
        return
    kind, name, start = event
    _write({"name": kind.upper(), "ph": "X", "ts": start, "dur": _now_us() - start,
            "pid": os.getpid(), "tid": name, "cat": kind})


def now() -> float | None:
    """A start time for begin(), or None when no timeline is written (costs nothing)."""
    return None if _file is None else _now_us()
