"""The GPU path settings every rank of a communicator agrees on (collective).

The path decides which MPI calls each rank makes, so the settings that choose it must be
the same on every rank of a communicator: the compiled choice (`backend/pathchoice.pyx`)
asks `agree` at a communicator's first eligible GPU call, and again after any ``set_*``.
A difference, or a bad setting on any rank, raises ValueError on every rank
(`fastreduce.agreement`).
"""

from __future__ import annotations

from .. import agreement
from ..backend import collectives, engine, pathchoice
from .calibration import thresholds_for
from .capabilities import DevicePointerSupport, device_pointer_support
from .modes import gpu_path_mode, pinned_thresholds

__all__ = ["agree", "install"]


def agree(comm) -> tuple[str, DevicePointerSupport, tuple]:
    """(mode, support, auto mode's size table) that every rank of comm agrees on (collective).

    None is the default communicator.
    """
    if comm is None:
        comm = collectives.default_comm()
    try:
        mode, _ = gpu_path_mode()
        support = device_pointer_support()
        pinned = pinned_thresholds() if mode == "auto" else None
        mine = {"mode": mode, "device pointers": support.calls(),
                "size table": pinned.spec() if pinned else "calibrated",
                "progress": "engine" if engine.state()[0] else "no engine"}
        error = None
    except ValueError as exc:
        mine, error = None, exc
    agreement.agree(comm, mine, error, refused=_refused, differ=_differ,
                    doing="GPU path settings agreement")
    if mode != "auto" or not (support.blocking or support.nonblocking):
        steps = ((0, "staged"),)  # not consulted: the mode or the MPI decides
    elif pinned is not None:
        steps = pinned.steps
    else:
        steps = thresholds_for(comm)
    return mode, support, steps


def _refused(ranks: list[int], listing: str) -> ValueError:
    return ValueError(f"fastreduce: {agreement.ranks_text(ranks)} of this communicator "
                      f"{'has' if len(ranks) == 1 else 'have'} a bad GPU path setting "
                      f"({listing})")


def _differ(found: agreement.Differences) -> ValueError:
    said = found.by_rank(lambda f: f"mode {f['mode']}, device pointers "
                                   f"{f['device pointers']}, size table {f['size table']}, "
                                   f"{f['progress']}")
    return ValueError(
        f"fastreduce: the ranks of this communicator disagree on the GPU path settings, "
        f"which decide the MPI calls each one makes ({said}); give every rank the same "
        f"FASTREDUCE_GPU_PATH, FASTREDUCE_GPU_THRESHOLDS(_FILE), FASTREDUCE_DEVICE_POINTERS, "
        f"FASTREDUCE_CUDA_AWARE and FASTREDUCE_ENGINE (and the same set_* calls)")


def install() -> None:
    """Hand `agree` to the compiled choice (at import, from fastreduce.configure)."""
    pathchoice.set_agreement(agree)
