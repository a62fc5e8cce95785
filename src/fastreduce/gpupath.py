"""How fastreduce reduces CUDA tensors: what each MPI promises, the settings, the calibration.

A CUDA tensor is reduced one of two ways:

- **direct**: its device pointer goes to MPI (no copies; the MPI reads GPU memory);
- **staged**: device -> pinned host memory -> MPI on the host -> device, pipelined
  in chunks for large messages.

Direct is allowed only where the MPI promises to take device pointers for that kind of
call (`mpi_promises`: Open MPI only in blocking collectives, for instance); everything
else is staged, whatever the settings say. Among the calls where both are allowed,
``FASTREDUCE_GPU_PATH`` (``auto``, ``direct``, ``staged``) decides; ``auto`` follows a
size table: pinned by ``FASTREDUCE_GPU_THRESHOLDS`` (or a file named by
``FASTREDUCE_GPU_THRESHOLDS_FILE``), else measured by `calibrate` the first time a
communicator's group needs it (collective, well under a second) and kept for the process.

Settings are read at the first GPU call; the ``set_*`` functions change them later.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from . import watchdog
from .errors import CalibrationError
from .sizes import format_size, parse_size

__all__ = [
    "CALIBRATION_SIZES",
    "CalibrationError",
    "DevicePointerSupport",
    "PathTable",
    "calibrate",
    "device_pointer_support",
    "gpu_path_mode",
    "gpu_path_settings",
    "mpi_promises",
    "parse_size",
    "pinned_thresholds",
    "set_device_pointer_calls",
    "set_gpu_path",
    "set_gpu_thresholds",
]

PATHS = ("direct", "staged")
MODES = ("auto", "direct", "staged")
CALLS = ("blocking", "nonblocking", "16bit")
# Message sizes the calibration times, both paths each (float32 sums).
CALIBRATION_SIZES = (8, 256, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


# --- what each MPI promises ---------------------------------------------------------

@dataclass(frozen=True)
class DevicePointerSupport:
    """Which all-reduce calls may hand device pointers to MPI, and why."""

    blocking: bool      # MPI_Allreduce
    nonblocking: bool   # MPI_Iallreduce
    half: bool          # ... with MPI's own 16-bit float datatypes too
    why: str

    def calls(self) -> str:
        """The allowed calls in words ("none" when every call is staged)."""
        names = [name for name, ok in (("blocking", self.blocking),
                                       ("non-blocking", self.nonblocking)) if ok]
        if not names:
            return "none"
        return " and ".join(names) + (", 16-bit floats too" if self.half else
                                      " (16-bit floats staged)")


# (family, blocking, non-blocking, 16-bit, what its documentation says). 16-bit floats
# go direct only where the MPI reduces them on the host itself (Open MPI's staging).
CAPABILITY_TABLE = (
    ("Open MPI (CUDA-aware build)", True, False, True,
     "device buffers in point-to-point and blocking collectives only; its non-blocking "
     "collectives reduce on the CPU and crash on device memory"),
    ("Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1", True, True, False,
     "GPU-attached buffers in all communication calls (without the variable: none)"),
    ("MVAPICH2-GDR / MVAPICH-Plus", True, True, False,
     "device buffers in collectives, blocking and non-blocking"),
    ("MPICH >= 4 (GPU support, yaksa)", True, True, False,
     "device buffers in all communication calls"),
    ("Intel MPI with I_MPI_OFFLOAD=1 or 2", True, False, False,
     "documents device buffers for blocking calls (MPI_Allreduce, MPI_Bcast, ...); "
     "without the variable: none"),
    ("MPICH 3.x", True, False, False, "collectives with ops stage device buffers"),
    ("any other CUDA-aware MPI", True, False, False, "blocking only, to be safe"),
)


def _row(index: int, note: str = "") -> DevicePointerSupport:
    family, blocking, nonblocking, half, says = CAPABILITY_TABLE[index]
    return DevicePointerSupport(blocking, nonblocking, half, f"{family}: {says}{note}")


def mpi_promises(library_version: str, cuda_aware: bool, how: str = "",
                 environ=None) -> DevicePointerSupport:
    """The table's answer for an MPI (its MPI_Get_library_version text) that is or is not
    CUDA-aware (`how`: how that was found out)."""
    environ = os.environ if environ is None else environ
    if not cuda_aware:
        return DevicePointerSupport(False, False, False,
                                    f"the MPI cannot read GPU memory ({how or 'not CUDA-aware'})")
    text = library_version
    if "Open MPI" in text:
        return _row(0)
    if "CRAY MPICH" in text.upper():
        if environ.get("MPICH_GPU_SUPPORT_ENABLED", "").strip() == "1":
            return _row(1)
        return DevicePointerSupport(False, False, False,
                                    "Cray MPICH without MPICH_GPU_SUPPORT_ENABLED=1 in the "
                                    "environment cannot read GPU memory")
    if "MVAPICH" in text.upper() and ("GDR" in text.upper() or "PLUS" in text.upper()):
        return _row(2)
    if "Intel(R) MPI" in text or "Intel MPI" in text:
        if environ.get("I_MPI_OFFLOAD", "").strip() in ("1", "2"):
            return _row(4)
        return DevicePointerSupport(False, False, False,
                                    "Intel MPI without I_MPI_OFFLOAD=1 in the environment does "
                                    "not take GPU buffers")
    match = re.search(r"MPICH Version:\s*(\d+)", text)
    if match:
        return _row(3) if int(match.group(1)) >= 4 else _row(5)
    return _row(6)


# --- settings ------------------------------------------------------------------------

_override_calls: DevicePointerSupport | None = None
_override_mode: str | None = None
_override_table: PathTable | None = None
_override_table_set = False


def _parse_calls(text: str, source: str) -> DevicePointerSupport:
    items = {t.strip().lower() for t in text.split(",") if t.strip()}
    if items == {"none"}:
        return DevicePointerSupport(False, False, False, f"{source}=none")
    unknown = items - set(CALLS)
    if unknown or not items:
        raise ValueError(f"fastreduce: {source}={text!r}: give 'none' or a comma-separated "
                         f"list of {', '.join(CALLS)} (the calls that may hand device "
                         f"pointers to MPI)")
    return DevicePointerSupport("blocking" in items, "nonblocking" in items, "16bit" in items,
                                f"{source}={text}")


def set_device_pointer_calls(calls: str | Iterable[str] | None) -> None:
    """Declare which calls may hand device pointers to MPI ("none", or some of "blocking",
    "nonblocking", "16bit"), overriding the table and FASTREDUCE_DEVICE_POINTERS;
    None: back to them. Only for MPIs you know accept them: a wrong promise crashes."""
    global _override_calls
    if calls is None:
        _override_calls = None
    else:
        text = calls if isinstance(calls, str) else ",".join(calls)
        _override_calls = _parse_calls(text, "set_device_pointer_calls()")
    _forget()


def device_pointer_support() -> DevicePointerSupport:
    """The calls that may hand device pointers to MPI here: the override, else the table."""
    if _override_calls is not None:
        return _override_calls
    setting = os.environ.get("FASTREDUCE_DEVICE_POINTERS", "").strip()
    if setting:
        return _parse_calls(setting, "FASTREDUCE_DEVICE_POINTERS")
    from .runtime import cuda_aware

    aware, how = cuda_aware()
    return mpi_promises(_library_version(), aware, how)


def _library_version() -> str:
    """MPI_Get_library_version's text (tests put other MPIs' answers here)."""
    from mpi4py import MPI

    return MPI.Get_library_version()


def set_gpu_path(mode: str | None) -> None:
    """"auto" (the size table), "direct" (wherever the MPI promises it) or "staged";
    None: back to FASTREDUCE_GPU_PATH (default auto)."""
    global _override_mode
    if mode is not None and mode not in MODES:
        raise ValueError(f"fastreduce: GPU path {mode!r}: use one of {', '.join(MODES)}")
    _override_mode = mode
    _forget()


def gpu_path_mode() -> tuple[str, str]:
    """(mode, where it was set)."""
    if _override_mode is not None:
        return _override_mode, "fastreduce.runtime.set_gpu_path()"
    setting = os.environ.get("FASTREDUCE_GPU_PATH", "").strip().lower()
    if not setting:
        return "auto", "default"
    if setting not in MODES:
        raise ValueError(f"fastreduce: FASTREDUCE_GPU_PATH={setting!r}: use one of "
                         f"{', '.join(MODES)}")
    return setting, "FASTREDUCE_GPU_PATH"


# --- size tables ---------------------------------------------------------------------

@dataclass(frozen=True)
class PathTable:
    """Which path a call of each size takes: steps of (from this many bytes, path)."""

    steps: tuple[tuple[int, str], ...]
    source: str = ""

    def __post_init__(self):
        starts = [start for start, _ in self.steps]
        if not self.steps or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"fastreduce: GPU path table {self.spec()!r}: its sizes must "
                             f"start at 0 and increase")
        if any(path not in PATHS for _, path in self.steps):
            raise ValueError(f"fastreduce: GPU path table {self.spec()!r}: paths are "
                             f"{' or '.join(PATHS)}")

    @classmethod
    def parse(cls, text: str, source: str = "") -> PathTable:
        """From "staged", "direct", or "0:direct,64KiB:staged,16MiB:direct"."""
        what = f"{source}={text!r}" if source else repr(text)
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        body = ",".join(line.removeprefix("FASTREDUCE_GPU_THRESHOLDS=") for line in lines
                        if line).strip(",")
        if body in PATHS:
            return cls(((0, body),), source)
        steps = []
        for item in [item for item in body.split(",") if item.strip()] or [""]:
            size, sep, path = item.strip().partition(":")
            try:
                if not sep or path.strip() not in PATHS:
                    raise ValueError
                steps.append((parse_size(size), path.strip()))
            except ValueError:
                raise ValueError(
                    f"fastreduce: GPU path table {what}: write 'direct', 'staged', or steps "
                    f"SIZE:PATH from 0 up, e.g. '0:direct,64KiB:staged,16MiB:direct'") from None
        try:
            return cls(tuple(steps), source)
        except ValueError as exc:
            raise ValueError(f"{exc} ({what})") from None

    def spec(self) -> str:
        """The table in the form FASTREDUCE_GPU_THRESHOLDS takes."""
        if len(self.steps) == 1:
            return self.steps[0][1]
        return ",".join(f"{format_size(start)}:{path}" for start, path in self.steps)

    def path_for(self, nbytes: int) -> str:
        """The path of an nbytes call (where both are allowed)."""
        chosen = self.steps[0][1]
        for start, path in self.steps:
            if nbytes >= start:
                chosen = path
        return chosen


def set_gpu_thresholds(table: str | PathTable | None) -> None:
    """Pin auto mode's size table for every communicator ("0:direct,64KiB:staged", or a
    PathTable), so no calibration runs; None: back to the environment settings."""
    global _override_table, _override_table_set
    if isinstance(table, str):
        table = PathTable.parse(table, "set_gpu_thresholds()")
    _override_table, _override_table_set = table, table is not None
    _forget()


def pinned_thresholds() -> PathTable | None:
    """The pinned size table in force (set_gpu_thresholds, FASTREDUCE_GPU_THRESHOLDS or
    FASTREDUCE_GPU_THRESHOLDS_FILE), or None: calibrate per communicator group."""
    if _override_table_set:
        return _override_table
    text = os.environ.get("FASTREDUCE_GPU_THRESHOLDS", "").strip()
    path = os.environ.get("FASTREDUCE_GPU_THRESHOLDS_FILE", "").strip()
    if text and path:
        raise ValueError("fastreduce: both FASTREDUCE_GPU_THRESHOLDS and "
                         "FASTREDUCE_GPU_THRESHOLDS_FILE are set; set one")
    if text:
        return PathTable.parse(text, "FASTREDUCE_GPU_THRESHOLDS")
    if path:
        try:
            with open(path) as f:
                content = f.read()
        except OSError as exc:
            raise ValueError(f"fastreduce: FASTREDUCE_GPU_THRESHOLDS_FILE={path!r} cannot be "
                             f"read ({exc.strerror}); write `fastreduce-info --calibrate`'s "
                             f"table line into it, or unset it") from None
        return PathTable.parse(content, f"FASTREDUCE_GPU_THRESHOLDS_FILE ({path})")
    return None


def gpu_path_settings() -> dict:
    """Everything that decides the GPU path here, in words (for fastreduce-info)."""
    mode, mode_source = gpu_path_mode()
    support = device_pointer_support()
    pinned = pinned_thresholds()
    if pinned is not None:
        table = f"{pinned.spec()} (pinned by {pinned.source})"
    elif _calibrated:
        table = "; ".join(f"{g.Get_size()} ranks: {PathTable(s).spec()}"
                          for g, s in _calibrated)
        table += " (calibrated)"
    else:
        table = "calibrated at the first eligible call on each communicator group"
    return {"mode": f"{mode} ({mode_source})",
            "device pointers": f"{support.calls()} ({support.why})",
            "size table": table if mode == "auto" else f"not used in {mode} mode"}


def _forget() -> None:
    from .backend import pathchoice as _gpupath

    _gpupath.forget()


def _agree(comm) -> tuple[str, DevicePointerSupport, tuple]:
    """(mode, support, auto mode's size table) that every rank of comm agrees on (collective).

    The settings decide which MPI calls each rank makes, so they must be the same on every
    rank: a difference, or a bad setting on any rank, raises ValueError on every rank.
    """
    try:
        mode, _ = gpu_path_mode()
        support = device_pointer_support()
        pinned = pinned_thresholds() if mode == "auto" else None
        from .backend import engine as _engine

        engine = "engine" if _engine.state()[0] else "no engine"
        mine = (mode, support.calls(), pinned.spec() if pinned else "calibrated", engine)
        error = None
    except ValueError as exc:
        mine, error = None, str(exc)
    with watchdog.recorded("GPU path settings agreement (MPI_Allgather)", comm):
        everyone = comm.allgather((mine, error))
    failed = [(rank, err) for rank, (_, err) in enumerate(everyone) if err]
    if error:
        raise ValueError(error)
    if failed:
        raise ValueError(f"fastreduce: rank {failed[0][0]} of this communicator has a bad GPU "
                         f"path setting ({failed[0][1]})")
    if len({m for m, _ in everyone}) > 1:
        by_setting: dict = {}
        for rank, (m, _) in enumerate(everyone):
            by_setting.setdefault(m, []).append(rank)
        said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r[:8]))}"
                         f"{'...' if len(r) > 8 else ''}: mode {m[0]}, device pointers "
                         f"{m[1]}, size table {m[2]}, {m[3]}" for m, r in by_setting.items())
        raise ValueError(
            f"fastreduce: the ranks of this communicator disagree on the GPU path settings, "
            f"which decide the MPI calls each one makes ({said}); give every rank the same "
            f"FASTREDUCE_GPU_PATH, FASTREDUCE_GPU_THRESHOLDS(_FILE), FASTREDUCE_DEVICE_POINTERS, "
            f"FASTREDUCE_CUDA_AWARE and FASTREDUCE_ENGINE (and the same set_* calls)")
    if mode != "auto" or not (support.blocking or support.nonblocking):
        steps = ((0, "staged"),)  # not consulted: the mode or the MPI decides
    elif pinned is not None:
        steps = pinned.steps
    else:
        steps = _thresholds_for(comm)
    return mode, support, steps


# Groups already calibrated in this process, with their steps: a communicator whose group
# has the same members reuses them (no collective). Consistent across ranks: every member
# of a group took part in its calibration.
_calibrated: list[tuple[object, tuple]] = []


def _thresholds_for(comm) -> tuple:
    """Steps for comm's group: reused, or calibrated now (collective over comm)."""
    from mpi4py import MPI

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
    from .backend import cudart as _cuda, reduce as _reduce

    count = nbytes // 4
    if path == "direct":
        whole = [count]
    else:
        chunk, nchunks = _cuda.plan_staging(nbytes)
        whole = [count] if nchunks <= 1 else (
            [chunk // 4] * (nchunks - 1) + [(nbytes - (nchunks - 1) * chunk) // 4])
    return [n for c in whole for n in _reduce._call_plan(c, 4)]


def _measure(comm, ptr: int, nbytes: int, path: str, reps: int) -> list[float]:
    """Seconds of each of `reps` calls (replaced in tests by fake timings)."""
    from .backend import staging as _staged

    return _staged._time_device_path(comm, ptr, nbytes, path, reps)


def _catch_up(comm, counts: list[int], done: int) -> None:
    """After a local failure: make the MPI calls this rank still owes the others, on host
    memory, so the collectives stay matched and the failure can be reported everywhere."""
    import numpy as np

    from .backend import collectives as _collectives

    for count in counts[done:]:
        _collectives.allreduce_(np.zeros(count, np.float32), comm=comm)


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
    from .backend import collectives as _collectives

    if comm is None:
        comm = _collectives.default_comm()
    with watchdog.recorded("GPU path calibration", comm):
        return _calibrate(comm, details)


def _calibrate(comm, details: bool):
    from .backend import cudart as _cuda, reduce as _reduce

    support = device_pointer_support()
    if not support.blocking:
        table = PathTable(((0, "staged"),), f"not calibrated: {support.why}")
        empty = ()
        return Calibration(empty, empty, empty, table) if details else table
    error = None
    ptr = None
    try:
        ptr = _cuda.device_alloc(max(CALIBRATION_SIZES))
    except Exception as exc:  # noqa: BLE001  (reported on every rank below)
        error = f"{type(exc).__name__}: {exc}"
    medians = []
    try:
        for nbytes in CALIBRATION_SIZES:
            for path in PATHS:
                reps = _reps(nbytes)
                counts = _call_counts(nbytes, path) * reps
                before = _reduce._mpi_call_count()
                median = math.nan
                if error is None:
                    try:
                        times = _measure(comm, ptr, nbytes, path, reps)
                        median = statistics.median(times[1:])
                    except Exception as exc:  # noqa: BLE001
                        error = f"{type(exc).__name__}: {exc}"
                try:
                    _catch_up(comm, counts, _reduce._mpi_call_count() - before)
                except Exception as exc:  # noqa: BLE001  (MPI is failing: report it below)
                    error = error or f"{type(exc).__name__}: {exc}"
                medians.append(median)
    finally:
        if ptr is not None:
            try:
                _cuda.device_free(ptr)
            except Exception as exc:  # noqa: BLE001
                error = error or f"{type(exc).__name__}: {exc}"
    everyone = comm.allgather((error, medians))
    failed = [(rank, err) for rank, (err, _) in enumerate(everyone) if err]
    if failed:
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
