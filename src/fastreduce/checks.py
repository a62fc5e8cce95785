"""Agreement between ranks before a collective, so that disagreement raises everywhere.

A collective that the ranks of a communicator call with different arguments is undefined
in MPI: it may return wrong data, hang, or crash the process (Open MPI's MPI_Cart_sub
with different remain_dims dies of SIGFPE). `agree()` exchanges a small description of
the call first, with one MPI_Allgather, and every rank raises the same
CollectiveMismatch when the descriptions differ, or when any rank refused its arguments.
"""

from __future__ import annotations

import os

from mpi4py import MPI

__all__ = ["CollectiveMismatch", "agree", "debug", "fingerprint", "set_debug"]


class CollectiveMismatch(RuntimeError):
    """The ranks of a communicator called a collective with different arguments: raised
    on every rank, naming what differs and which ranks passed what."""

    def __init__(self, message: str, differences: dict | None = None):
        super().__init__(message)
        self.differences = differences or {}  # field -> {value: [ranks]}


def _ranks_by_value(values: list) -> dict:
    grouped: dict = {}
    for rank, value in enumerate(values):
        grouped.setdefault(repr(value), []).append(rank)
    return grouped


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def agree(comm: MPI.Comm, what: str, fields: dict, error: BaseException | None = None) -> None:
    """Collective over comm: every rank passes the same `what` and `fields`, and no rank an
    `error` (its own validation failure, raised here on that rank after the exchange so the
    others are not left waiting). Otherwise every rank raises: the refusing ranks their own
    error, the others CollectiveMismatch."""
    mine = (what, fields, None if error is None else f"{type(error).__name__}: {error}")
    everyone = comm.allgather(mine)
    refused = [(r, e) for r, (_, _, e) in enumerate(everyone) if e is not None]
    if refused:
        if error is not None:
            raise error
        listing = "; ".join(f"rank {r}: {e}" for r, e in refused)
        raise CollectiveMismatch(f"fastreduce: {what}: {_ranks_text([r for r, _ in refused])} "
                                 f"refused the call, so no rank makes it ({listing})")
    if all(other == mine for other in everyone):
        return
    differences = {}
    whats = [w for w, _, _ in everyone]
    if len(set(whats)) > 1:
        differences["call"] = _ranks_by_value(whats)
    keys = sorted({k for _, f, _ in everyone for k in f})
    for key in keys:
        values = [f.get(key, "<missing>") for _, f, _ in everyone]
        if any(v != values[0] for v in values):
            differences[key] = _ranks_by_value(values)
    parts = []
    for key, by_value in differences.items():
        seen = ", ".join(f"{_ranks_text(ranks)} passed {value}"
                         for value, ranks in by_value.items())
        parts.append(f"{key}: {seen}")
    # the same text on every rank: name the call only where every rank made it
    called = "made different calls" if "call" in differences else f"called {what} differently"
    raise CollectiveMismatch(
        f"fastreduce: the ranks of a communicator of {comm.Get_size()} {called} "
        f"({'; '.join(parts)}); every rank must make the same collective calls in the same "
        f"order with the same arguments", differences)


# --- debug mode ---------------------------------------------------------------------------

_debug = False
_sequence_keyval: int | None = None


def set_debug(on: bool | None) -> bool:
    """Debug mode on or off (None: as FASTREDUCE_DEBUG says); returns the previous setting.

    In debug mode every collective fastreduce issues (allreduce in every form, coalesced,
    GradientSync's buckets, the layers, the torch.distributed backend) is preceded by one
    small collective on its communicator in which the ranks compare a fingerprint: a
    per-communicator sequence number, the call, element count, dtype, op and device. Any
    difference raises CollectiveMismatch on every rank instead of a hang, a crash or wrong
    data. Every rank must use the same setting."""
    global _debug
    from . import _collectives

    old = _debug
    if on is None:
        text = os.environ.get("FASTREDUCE_DEBUG", "").strip()
        if text not in ("", "0", "1"):
            raise ValueError(f"FASTREDUCE_DEBUG={text!r}: use 0 or 1")
        on = text == "1"
    _debug = bool(on)
    _collectives._set_debug(_debug)
    return old


def debug() -> bool:
    """Whether debug mode is on."""
    return _debug


def _next_sequence(comm: MPI.Comm) -> int:
    """This communicator's count of checked collectives (kept in an MPI attribute)."""
    global _sequence_keyval
    if _sequence_keyval is None:
        _sequence_keyval = MPI.Comm.Create_keyval()
    counter = comm.Get_attr(_sequence_keyval)
    if counter is None:
        counter = [0]
        comm.Set_attr(_sequence_keyval, counter)
    counter[0] += 1
    return counter[0]


def fingerprint(comm: MPI.Comm, call: str, **fields) -> None:
    """Debug mode: the ranks of comm agree on this call (see set_debug)."""
    agree(comm, call, {"sequence number": _next_sequence(comm), **fields})
