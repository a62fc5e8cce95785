"""What the MPI can do with GPU memory: whether it can read it at all, and which all-reduce
calls may hand it device pointers.

Direct is allowed only where the MPI promises to take device pointers for that kind of
call: `mpi_promises` looks the MPI up in `CAPABILITY_TABLE` (Open MPI only in blocking
collectives, for instance). ``FASTREDUCE_DEVICE_POINTERS`` or `set_device_pointer_calls`
replace the table's answer, ``FASTREDUCE_CUDA_AWARE`` or `set_cuda_aware` the MPI's own
answer to whether it can read GPU memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from mpi4py import MPI

from .. import settings
from ..backend import mpierrors, pathchoice

__all__ = ["CALLS", "CAPABILITY_TABLE", "DevicePointerSupport", "cuda_aware",
           "device_pointer_support", "mpi_promises", "set_cuda_aware",
           "set_device_pointer_calls"]

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


# --- the user's declaration ------------------------------------------------------------

_override_calls: DevicePointerSupport | None = None


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
    pathchoice.forget()


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
    declared = declared_calls()
    if declared is not None:
        return declared
    aware, how = cuda_aware()
    return mpi_promises(_library_version(), aware, how)


def declared_calls() -> DevicePointerSupport | None:
    """FASTREDUCE_DEVICE_POINTERS parsed (None when unset); ValueError if it is bad."""
    setting = settings.value("FASTREDUCE_DEVICE_POINTERS")
    return _parse_calls(setting, "FASTREDUCE_DEVICE_POINTERS") if setting else None


def _library_version() -> str:
    """MPI_Get_library_version's text (tests put other MPIs' answers here)."""
    return MPI.Get_library_version()
