"""The settings that choose between the two GPU paths where the MPI allows both.

``FASTREDUCE_GPU_PATH`` (or `set_gpu_path`): ``auto``, ``direct`` or ``staged``. ``auto``
follows a size table (`PathTable`): pinned by ``FASTREDUCE_GPU_THRESHOLDS`` (or a file
named by ``FASTREDUCE_GPU_THRESHOLDS_FILE``, or `set_gpu_thresholds`), else calibrated per
communicator group (`fastreduce.gpupaths.calibration`). Read at a communicator's first GPU
call; each ``set_*`` makes every communicator agree again at its next one.
"""

from __future__ import annotations

from typing import ClassVar

from .. import settings
from ..backend import pathchoice
from ..sizes import SizeTable

__all__ = ["MODES", "PATHS", "PathTable", "gpu_path_mode", "pinned_thresholds",
           "set_gpu_path", "set_gpu_thresholds"]

PATHS = ("direct", "staged")
MODES = ("auto", "direct", "staged")

_override_mode: str | None = None
_override_table: PathTable | None = None
_override_table_set = False


class PathTable(SizeTable):
    """Which path a call of each size takes: steps of (from this many bytes, path)."""

    CHOICES: ClassVar[tuple[str, ...]] = PATHS
    WHAT: ClassVar[str] = "GPU path table"
    SETTING: ClassVar[str] = "FASTREDUCE_GPU_THRESHOLDS"
    EXAMPLE: ClassVar[str] = "0:direct,64KiB:staged,16MiB:direct"
    STEP: ClassVar[str] = "SIZE:PATH"

    def path_for(self, nbytes: int) -> str:
        """The path of an nbytes call."""
        return self.choice_for(nbytes)


def set_gpu_path(mode: str | None) -> None:
    """"auto" (the size table), "direct" (wherever the MPI promises it) or "staged";
    None: back to FASTREDUCE_GPU_PATH (default auto)."""
    global _override_mode
    if mode is not None and mode not in MODES:
        raise ValueError(f"fastreduce: GPU path {mode!r}: use one of {', '.join(MODES)}")
    _override_mode = mode
    pathchoice.forget()


def gpu_path_mode() -> tuple[str, str]:
    """(mode, where it was set)."""
    if _override_mode is not None:
        return _override_mode, "fastreduce.gpupaths.set_gpu_path()"
    if not settings.is_set("FASTREDUCE_GPU_PATH"):
        return "auto", "default"
    return settings.value("FASTREDUCE_GPU_PATH"), "FASTREDUCE_GPU_PATH"


def set_gpu_thresholds(table: str | PathTable | None) -> None:
    """Pin auto mode's size table for every communicator ("0:direct,64KiB:staged", or a
    PathTable), so no calibration runs; None: back to the environment settings."""
    global _override_table, _override_table_set
    if isinstance(table, str):
        table = PathTable.parse(table, "set_gpu_thresholds()")
    _override_table, _override_table_set = table, table is not None
    pathchoice.forget()


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
