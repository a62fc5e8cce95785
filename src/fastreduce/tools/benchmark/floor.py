"""The C floor: bench/floor.c (installed beside this module), the MPI calls in C loops with
no Python between calls, compiled with mpicc on each node and loaded with ctypes into the
benchmark's own MPI job."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mpi4py import MPI

from ..._abi import first_line

_HERE = Path(__file__).resolve().parent
# installed: beside this module; in a source tree: the repository's bench/floor.c
SOURCES = (_HERE / "floor.c", _HERE.parents[3] / "bench" / "floor.c")

_I, _P, _D = ctypes.c_int, ctypes.c_void_p, ctypes.c_double
SIGNATURES = {  # name: argument types (each returns seconds per call, or -MPI error)
    "floor_allreduce": [_I, _P, _P, _I, _I, _I],
    "floor_allreduce_typed": [_I, _P, _P, _I, _I, _I, _I, _I],
    "floor_bcast": [_I, _P, _I, _I, _I, _I, _I],
    "floor_reduce": [_I, _P, _P, _I, _I, _I, _I, _I, _I],
    "floor_allgather": [_I, _P, _P, _I, _I, _I, _I],
    "floor_reduce_scatter_block": [_I, _P, _P, _I, _I, _I, _I, _I],
    "floor_alltoall": [_I, _P, _P, _I, _I, _I, _I],
    "floor_gather": [_I, _P, _P, _I, _I, _I, _I, _I],
    "floor_scatter": [_I, _P, _P, _I, _I, _I, _I, _I],
}


class FloorUnavailable(RuntimeError):
    """The C floor could not be built or loaded here (no mpicc, a compile error)."""


def mpicc() -> str | None:
    """$MPICC, else the mpicc beside this Python (the MPI wheels' venvs), else on PATH."""
    named = os.environ.get("MPICC")
    if named:
        return named
    beside = Path(sys.executable).parent / "mpicc"
    return str(beside) if beside.exists() else shutil.which("mpicc")


def _compile(source: Path, target: Path, compiler: str) -> str | None:
    """Compile source into target (atomically: a concurrent job sees the whole file or
    none); an error message, or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, "-O2", "-shared", "-fPIC", str(source), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        os.unlink(tmp)
        return f"{' '.join(cmd)}: {exc}"
    if proc.returncode:
        os.unlink(tmp)
        return f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}"
    os.replace(tmp, target)
    return None


def load(world: MPI.Intracomm):
    """The floor library on every rank of world (collective over world): compiled once per
    node by its first rank into a per-user cache in the temporary folder, named by the
    source, the compiler and the MPI library, so later runs reuse it. Raises
    FloorUnavailable on every rank where any rank could not have it."""
    source = next((s for s in SOURCES if s.exists()), None)
    compiler = mpicc()
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    error, target = None, None
    try:
        if source is None:
            error = f"floor.c is not installed (looked in {', '.join(map(str, SOURCES))})"
        elif compiler is None:
            error = "no mpicc: set MPICC to the compiler of the MPI this job runs"
        else:
            key = hashlib.sha256(source.read_bytes() + compiler.encode()
                                 + first_line(MPI.Get_library_version()).encode())
            folder = Path(tempfile.gettempdir()) / f"fastreduce-floor-{os.getuid()}"
            target = folder / f"floor-{key.hexdigest()[:16]}.so"
            if node.Get_rank() == 0 and not target.exists():
                error = _compile(source, target, compiler)
        node.Barrier()
    finally:
        node.Free()
    errors = [e for e in world.allgather(error) if e]
    if errors:
        raise FloorUnavailable(errors[0])
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        error = f"{target}: {exc}"
    errors = [e for e in world.allgather(error) if e]
    if errors:
        raise FloorUnavailable(errors[0])
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _D, argtypes
    return lib
