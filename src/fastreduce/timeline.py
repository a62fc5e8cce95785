"""Chrome trace files (chrome://tracing, Perfetto): the format of Horovod's timeline, written
by `fastreduce.horovod` (HOROVOD_TIMELINE) and by the bucket engine (GradientSync(timeline=))."""

from __future__ import annotations

import json
import os
import threading
import time

__all__ = ["Trace", "now_us"]


def now_us() -> float:
    """The trace clock: microseconds of time.perf_counter."""
    return time.perf_counter_ns() / 1000.0


class Trace:
    """A JSON array of trace events, written as they come (flushed with flush())."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "w")  # noqa: SIM115  (open until close())
        self._file.write("[\n")
        self._first = True
        self._pid = os.getpid()

    def complete(self, name: str, category: str, row: str, start_us: float, end_us: float,
                 args: dict | None = None) -> None:
        """A span ("X" event) on row `row`, from start_us to end_us (now_us() values)."""
        event = {"name": name, "cat": category, "ph": "X", "ts": start_us,
                 "dur": max(end_us - start_us, 0.0), "pid": self._pid, "tid": row}
        if args:
            event["args"] = args
        self._write(event)

    def _write(self, event: dict) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write(("" if self._first else ",\n") + json.dumps(event))
            self._first = False

    def flush(self) -> None:
        """Make what was written so far visible in the file."""
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """End the array: a valid JSON file from here on."""
        with self._lock:
            if self._file is None:
                return
            self._file.write("\n]\n")
            self._file.close()
            self._file = None

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._file is None
