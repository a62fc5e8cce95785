"""How fastreduce reduces CUDA tensors: what each MPI promises, the settings, the size tables.

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
communicator's group needs it (collective, well under a second; `fastreduce.calibration`)
and kept for the process.

Settings are read at the first GPU call; the ``set_*`` functions change them later.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from mpi4py import MPI

from . import settings
from .backend import mpierrors, pathchoice
from .sizes import format_size, parse_size

__all__ = [
    "DevicePointerSupport",
    "PathTable",
    "cuda_aware",
    "device_pointer_support",
    "gpu_path_mode",
    "gpu_path_settings",
    "mpi_promises",
    "parse_size",
    "pinned_thresholds",
    "set_cuda_aware",
    "set_device_pointer_calls",
    "set_gpu_path",
    "set_gpu_thresholds",
]

PATHS = ("direct", "staged")
MODES = ("auto", "direct", "staged")
CALLS = ("blocking", "nonblocking", "16bit")


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
        return " and ".join(names) + (", 16-bit floats too (FASTREDUCE_HALF_OPS=mpi)"
                                      if self.half else " (16-bit floats staged)")


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


# --- whether the MPI can read GPU memory at all -------------------------------------

_cuda_aware_override: bool | None = None


def set_cuda_aware(value: bool | None) -> None:
    """Declare whether the MPI can read GPU memory (None: detect again).

    The GPU paths ask cuda_aware() once, at their first call, and keep the answer
    until this is called; FASTREDUCE_CUDA_AWARE is read then too.
    """
    global _cuda_aware_override
    _cuda_aware_override = None if value is None else bool(value)
    pathchoice.forget()


def cuda_aware() -> tuple[bool, str]:
    """(answer, how it was reached): the Python switch, FASTREDUCE_CUDA_AWARE, the MPI's
    own query (MPIX_Query_cuda_support / MPIX_GPU_query_support / the MPI 4.1
    mpi_memory_alloc_kinds info), else not CUDA-aware."""
    if _cuda_aware_override is not None:
        return _cuda_aware_override, "fastreduce.set_cuda_aware()"
    setting = settings.value("FASTREDUCE_CUDA_AWARE")
    if setting is not None:
        return setting, "FASTREDUCE_CUDA_AWARE"
    answer = mpierrors.mpi_cuda_query()
    if answer is not None:
        return answer
    kinds = _memory_alloc_kinds()
    if kinds is not None:
        return ("cuda" in kinds.split(",") or any(k.startswith("cuda:") for k in
                                                  kinds.split(","))), \
            f"mpi_memory_alloc_kinds={kinds!r}"
    return False, "no query available in this MPI: assumed not CUDA-aware"


def _memory_alloc_kinds() -> str | None:
    try:
        info = MPI.COMM_WORLD.Get_info()
    except MPI.Exception:
        return None
    try:
        return info.Get("mpi_memory_alloc_kinds")
    finally:
        info.Free()


def device_pointer_support() -> DevicePointerSupport:
    """The calls that may hand device pointers to MPI here: the override, else the table."""
    if _override_calls is not None:
        return _override_calls
    setting = settings.value("FASTREDUCE_DEVICE_POINTERS")
    if setting:
        return _parse_calls(setting, "FASTREDUCE_DEVICE_POINTERS")
    aware, how = cuda_aware()
    return mpi_promises(_library_version(), aware, how)


def _library_version() -> str:
    """MPI_Get_library_version's text (tests put other MPIs' answers here)."""
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
    if not settings.is_set("FASTREDUCE_GPU_PATH"):
        return "auto", "default"
    return settings.value("FASTREDUCE_GPU_PATH"), "FASTREDUCE_GPU_PATH"


# --- size tables ---------------------------------------------------------------------

@dataclass(frozen=True)
class PathTable:
    """Which path a call of each size takes: steps of (from this many bytes, path)."""

    steps: tuple[tuple[int, str], ...]
    source: str = ""

    # what the table chooses among, its name in messages, its setting and an example
    CHOICES: ClassVar[tuple[str, ...]] = PATHS
    WHAT: ClassVar[str] = "GPU path table"
    SETTING: ClassVar[str] = "FASTREDUCE_GPU_THRESHOLDS"
    EXAMPLE: ClassVar[str] = "0:direct,64KiB:staged,16MiB:direct"
    STEP: ClassVar[str] = "SIZE:PATH"

    def __post_init__(self):
        starts = [start for start, _ in self.steps]
        if not self.steps or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"fastreduce: {self.WHAT} {self.spec()!r}: its sizes must "
                             f"start at 0 and increase")
        if any(path not in self.CHOICES for _, path in self.steps):
            raise ValueError(f"fastreduce: {self.WHAT} {self.spec()!r}: the choices are "
                             f"{', '.join(self.CHOICES)}")

    @classmethod
    def parse(cls, text: str, source: str = "") -> PathTable:
        """From one choice ("staged"), or steps "0:direct,64KiB:staged,16MiB:direct"."""
        what = f"{source}={text!r}" if source else repr(text)
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        body = ",".join(line.removeprefix(f"{cls.SETTING}=") for line in lines
                        if line).strip(",")
        if body in cls.CHOICES:
            return cls(((0, body),), source)
        steps = []
        for item in [item for item in body.split(",") if item.strip()] or [""]:
            size, sep, path = item.strip().partition(":")
            try:
                if not sep or path.strip() not in cls.CHOICES:
                    raise ValueError
                steps.append((parse_size(size), path.strip()))
            except ValueError:
                raise ValueError(
                    f"fastreduce: {cls.WHAT} {what}: write one of "
                    f"{', '.join(map(repr, cls.CHOICES))}, or steps {cls.STEP} from 0 up, "
                    f"e.g. {cls.EXAMPLE!r}") from None
        try:
            return cls(tuple(steps), source)
        except ValueError as exc:
            raise ValueError(f"{exc} ({what})") from None

    def spec(self) -> str:
        """The table in the form its setting takes."""
        if len(self.steps) == 1:
            return self.steps[0][1]
        return ",".join(f"{format_size(start)}:{path}" for start, path in self.steps)

    def path_for(self, nbytes: int) -> str:
        """The choice for an nbytes call."""
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
    text = settings.value("FASTREDUCE_GPU_THRESHOLDS")
    path = settings.value("FASTREDUCE_GPU_THRESHOLDS_FILE")
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
    pathchoice.forget()


# Groups already calibrated in this process, with their steps: a communicator whose group
# has the same members reuses them (no collective). Consistent across ranks: every member
# of a group took part in its calibration.
_calibrated: list[tuple[object, tuple]] = []
