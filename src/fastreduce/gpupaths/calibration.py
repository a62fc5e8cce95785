"""The calibration of the GPU path size table: both paths timed on every rank of a
communicator, the slowest rank's answer kept (collective).

`calibrate` runs at the first eligible call on a communicator whose group has no table yet
(auto mode, nothing pinned), or from `fastreduce-info --calibrate`; each group's table is
kept for the process, and a communicator of the same members reuses it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .. import watchdog
from ..backend import collectives, cudart, reduce, staging
from ..errors import CalibrationError
from .capabilities import device_pointer_support
from .modes import PATHS, PathTable

__all__ = ["CALIBRATION_SIZES", "Calibration", "CalibrationError", "calibrate",
           "calibrated_tables"]

# Message sizes the calibration times, both paths each (float32 sums).
CALIBRATION_SIZES = (8, 256, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


# Groups already calibrated in this process, with their steps: a communicator whose group
# has the same members reuses them (no collective). Consistent across ranks: every member
# of a group took part in its calibration.
_calibrated: list[tuple[object, tuple]] = []


def calibrated_tables() -> list[tuple[int, PathTable]]:
    """(ranks, table) of every communicator group calibrated so far in this process."""
    return [(group.Get_size(), PathTable(steps)) for group, steps in _calibrated]


def thresholds_for(comm) -> tuple:
    """Steps for comm's group: reused, or calibrated now (collective over comm)."""
    group = comm.Get_group()
    for known, steps in _calibrated:
        if group.Compare(known) in (MPI.IDENT, MPI.SIMILAR):
            group.Free()
            return steps
    result = calibrate(comm, details=True)
    if result.sizes:  # measured (not "staged: nothing can go direct"): keep it
        _calibrated.append((group, result.table.steps))
    return result.table.steps


def _reps(nbytes: int) -> int:
    """Calls per measurement, the first one untimed (the same on every rank)."""
    return 21 if nbytes <= 64 << 10 else 9 if nbytes <= 1 << 20 else 4


def _call_counts(nbytes: int, path: str) -> list[int]:
    """The element counts of the MPI_Allreduce calls one blocking float32 call of nbytes
    makes by a path (staged chunks, and segments of either)."""
    count = nbytes // 4
    if path == "direct":
        whole = [count]
    else:
        chunk, nchunks = cudart.plan_staging(nbytes)
        whole = [count] if nchunks <= 1 else (
            [chunk // 4] * (nchunks - 1) + [(nbytes - (nchunks - 1) * chunk) // 4])
    return [n for c in whole for n in reduce._call_plan(c, 4)]


def _measure(comm, ptr: int, nbytes: int, path: str, reps: int) -> list[float]:
    """Seconds of each of `reps` calls (replaced in tests by fake timings)."""
    return staging._time_device_path(comm, ptr, nbytes, path, reps)


def _catch_up(comm, counts: list[int], done: int) -> None:
    """After a local failure: make the MPI calls this rank still owes the others, on host
    memory, so the collectives stay matched and the failure can be reported everywhere."""
    for count in counts[done:]:
        collectives.allreduce_(np.zeros(count, np.float32), comm=comm)


@dataclass(frozen=True)
class Calibration:
    """A calibration's measurements (slowest rank's median, seconds) and the table."""

    sizes: tuple[int, ...]
    direct: tuple[float, ...]
    staged: tuple[float, ...]
    table: PathTable


def calibrate(comm=None, *, details: bool = False):
    """Time both paths on this communicator's current GPUs and return the size table
    (a Calibration with the timings when `details`). Collective over comm.

    Every rank times float32 sums of CALIBRATION_SIZES by both paths; a size goes direct
    where the slowest rank's median is lower. A failure on any rank (a CUDA or MPI error)
    raises the same CalibrationError on every rank.
    """
    if comm is None:
        comm = collectives.default_comm()
    with watchdog.recorded("GPU path calibration", comm):
        return _calibrate(comm, details)


def _calibrate(comm, details: bool):
    support = device_pointer_support()
    if not support.blocking:
        table = PathTable(((0, "staged"),), f"not calibrated: {support.why}")
        empty = ()
        return Calibration(empty, empty, empty, table) if details else table
    error = None
    ptr = None
    try:
        ptr = cudart.device_alloc(max(CALIBRATION_SIZES))
    except Exception as exc:  # noqa: BLE001  (reported on every rank below)
        error = f"{type(exc).__name__}: {exc}"
    medians = []
    try:
        for nbytes in CALIBRATION_SIZES:
            for path in PATHS:
                reps = _reps(nbytes)
                counts = _call_counts(nbytes, path) * reps
                before = reduce._mpi_call_count()
                median = math.nan
                if error is None:
                    try:
                        times = _measure(comm, ptr, nbytes, path, reps)
                        median = statistics.median(times[1:])
                    except Exception as exc:  # noqa: BLE001
                        error = f"{type(exc).__name__}: {exc}"
                try:
                    _catch_up(comm, counts, reduce._mpi_call_count() - before)
                except Exception as exc:  # noqa: BLE001  (MPI is failing: report it below)
                    error = error or f"{type(exc).__name__}: {exc}"
                medians.append(median)
    finally:
        if ptr is not None:
            try:
                cudart.device_free(ptr)
            except Exception as exc:  # noqa: BLE001
                error = error or f"{type(exc).__name__}: {exc}"
    everyone = comm.allgather((error, medians))
    failed = [(rank, err) for rank, (err, _) in enumerate(everyone) if err]
    if failed:  # the same error on every rank, the failing ones too
        ranks = ", ".join(str(rank) for rank, _ in failed)
        raise CalibrationError(
            f"fastreduce: the GPU path calibration failed on rank {ranks} of "
            f"{comm.Get_size()} (rank {failed[0][0]}: {failed[0][1]}); fix that, or skip "
            f"the calibration: FASTREDUCE_GPU_PATH=staged, or pin the sizes with "
            f"FASTREDUCE_GPU_THRESHOLDS")
    slowest = [max(values[i] for _, values in everyone) for i in range(len(medians))]
    direct, staged = slowest[0::2], slowest[1::2]
    chosen = ["direct" if d < s else "staged" for d, s in zip(direct, staged, strict=True)]
    steps = [(0, chosen[0])]
    for i in range(1, len(chosen)):
        if chosen[i] != chosen[i - 1]:  # switch half-way (geometrically) between the sizes
            start = int(math.sqrt(CALIBRATION_SIZES[i - 1] * CALIBRATION_SIZES[i]))
            steps.append((start // 4 * 4, chosen[i]))
    table = PathTable(tuple(steps), f"calibrated on {comm.Get_size()} ranks")
    if details:
        return Calibration(CALIBRATION_SIZES, tuple(direct), tuple(staged), table)
    return table
