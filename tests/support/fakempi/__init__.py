"""A fake MPI layer for tests: records the kind of memory (host, device, pinned) that each
MPI_Allreduce / MPI_Iallreduce call is handed, and passes the call on to the real MPI.

It is a PMPI interposer (pointerlog.c) built with the MPI's own mpicc and loaded with
RTLD_GLOBAL before fastreduce, whose calls then go through it. Device and pinned memory are
recognised by the fake CUDA runtime (tests/support/fakecuda), so it is used with that runtime:

    import fakempi
    fakempi.install()            # before `import fastreduce`
    import fastreduce
    fakempi.reset()
    ...
    assert fakempi.counts()["iallreduce"]["device"] == 0
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from pathlib import Path

import fakecuda

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "pointerlog.c"
CALLS = ("allreduce", "iallreduce")
KINDS = ("host", "device", "pinned")


class _Counts(ctypes.Structure):
    _fields_ = [("calls", (ctypes.c_uint64 * len(KINDS)) * len(CALLS))]


def _mpicc() -> str:
    """The mpicc of the MPI that mpi4py and fastreduce use (this venv's, else PATH's)."""
    here = Path(sys.executable).parent / "mpicc"
    found = str(here) if here.exists() else os.environ.get("MPICC") or shutil.which("mpicc")
    if not found:
        raise RuntimeError("fakempi: no mpicc found to build the pointer log")
    return found


_lib: ctypes.CDLL | None = None


def install() -> ctypes.CDLL:
    """Build (once) and load the pointer log ahead of the MPI library; returns it."""
    global _lib
    if _lib is None:
        if "fastreduce.backend.collectives" in sys.modules:
            raise RuntimeError("fakempi.install() must come before `import fastreduce`")
        mpicc = _mpicc()
        path = fakecuda.build_in_test_tree(lambda d: fakecuda.build_library(
            SOURCE, "libpointerlog", d or HERE / "_build", mpicc, ["-O1", "-shared", "-fPIC"],
            []))
        lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        lib.pointerlog_set_classifier.argtypes = [ctypes.c_void_p]
        lib.pointerlog_get_counts.argtypes = [ctypes.POINTER(_Counts)]
        lib.pointerlog_counts_size.restype = ctypes.c_size_t
        if lib.pointerlog_counts_size() != ctypes.sizeof(_Counts):
            raise RuntimeError("fakempi: _Counts does not match the C struct")
        classify = ctypes.cast(fakecuda.lib().fakecuda_pointer_kind, ctypes.c_void_p).value
        lib.pointerlog_set_classifier(classify)
        _lib = lib
    return _lib


def counts() -> dict[str, dict[str, int]]:
    """{"allreduce": {"host": n, "device": n, "pinned": n}, "iallreduce": {...}} so far."""
    out = _Counts()
    install().pointerlog_get_counts(ctypes.byref(out))
    return {call: {kind: out.calls[i][j] for j, kind in enumerate(KINDS)}
            for i, call in enumerate(CALLS)}


class _CallRecord(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint64), ("start_ns", ctypes.c_int64),
                ("end_ns", ctypes.c_int64)]


def log_calls(capacity: int) -> None:
    """Record when the next `capacity` blocking MPI_Allreduce calls run (0: stop)."""
    fn = install().pointerlog_log_calls
    fn.argtypes = [ctypes.c_size_t]
    if fn(capacity):
        raise MemoryError("fakempi: no memory for the call log")


def calls() -> list[dict]:
    """The blocking all-reduces recorded since log_calls(): bytes, start and end
    (CLOCK_MONOTONIC ns, the fake CUDA runtime's copy log's clock), in the order they
    ended."""
    fn = install().pointerlog_calls
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.POINTER(_CallRecord), ctypes.c_size_t]
    n = fn(None, 0)
    out = (_CallRecord * n)()
    n = min(n, fn(out, n))
    return [{"bytes": r.bytes, "start": r.start_ns, "end": r.end_ns} for r in out[:n]]


def reset() -> None:
    install().pointerlog_reset()
