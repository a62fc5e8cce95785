"""Before every collective the ranks of its process set agree on it, as Horovod's
coordinator does: one MPI_Allgather of 16 bytes per rank (a status and a digest of the
call's kind, name, dtype, shape, op, factors and root). When every rank sent the same, the
collective runs; otherwise the full descriptions are exchanged and every rank raises the
same error naming what differs, or, where ranks have called join(), those ranks learn
the call and take part in it with empty input. A rank that shuts down (hvd.shutdown(), or
the end of its program) sends its last status: ranks still waiting in a collective on the
set learn it there and raise, and every later collective on the set raises at once, as
Horovod's "has been shut down".
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ... import agreement
from ...errors import CollectiveMismatch, FastreduceError

ACTIVE, JOINED, REFUSED, BLOCKING, SHUTDOWN = 0, 1, 2, 4, 8  # BLOCKING: ACTIVE, waits at once
_MASK = (1 << 62) - 1
_digests: dict = {}
_buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
_gone: dict[int, list[int]] = {}  # comm handle -> the ranks of it that have shut down


class HorovodInternalError(FastreduceError, RuntimeError):
    """An operation failed (Horovod's name for the error its collectives raise)."""


class HorovodArgumentError(FastreduceError, ValueError, RuntimeError):
    """An argument Horovod refuses with a RuntimeError (e.g. hvd.Adasum in reducescatter):
    a ValueError as fastreduce's refusals are, and a RuntimeError as Horovod's."""


class HorovodMismatch(CollectiveMismatch, HorovodInternalError):
    """The ranks of a process set submitted different collectives (name, dtype, shape, op,
    root...) or a rank refused its arguments: raised on every rank of the set."""


def _digest(key: tuple, name: str) -> int:
    """A digest of the call (key: its description but the name), the same on every rank
    (Python's hash() is not)."""
    value = _digests.get(key)
    if value is None:
        if len(_digests) > 4096:
            _digests.clear()
        value = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(),
                               "little")
        _digests[key] = value
    return (value ^ zlib.crc32(name.encode()) * 0x9E3779B1) & _MASK


def _exchange(comm: MPI.Intracomm, status: int, value: int) -> tuple[np.ndarray, bool]:
    """Every rank's (status, value); and whether all sent the same."""
    size = comm.Get_size()
    send, recv = _buffers.get(size) or _buffers.setdefault(
        size, (np.empty(2, np.int64), np.empty(2 * size, np.int64)))
    send[0] = status
    send[1] = value
    comm.Allgather(send, recv)
    return recv.reshape(size, 2), recv.tobytes() == send.tobytes() * size


def agree(comm: MPI.Intracomm, key: tuple, name: str, describe: Callable[[], dict],
          error: BaseException | None = None, blocking: bool = False):
    """Collective over the set's comm: (joined ranks, whether every rank waits at once).
    Every rank submitted this call (key and name; describe() makes the call's description,
    needed only when they differ); the joined ranks, if any, take part. Raises on every
    rank when the calls differ or a rank passes an `error` (its own, raised there)."""
    _raise_if_gone(comm)
    status = REFUSED if error is not None else BLOCKING if blocking else ACTIVE
    everyone, alike = _exchange(comm, status, _digest(key, name))
    if alike and status != REFUSED:
        return None, blocking
    _learn_gone(comm, everyone)
    statuses = everyone[:, 0]
    if ((statuses == ACTIVE) | (statuses == BLOCKING)).all() and \
            (everyone[:, 1] == everyone[0, 1]).all():
        return None, False  # some wait at once, some later: all take the non-blocking path
    return _slow(comm, status, describe(), error), False


def agree_call(comm: MPI.Intracomm, call: str, fields: dict,
               error: BaseException | None = None) -> None:
    """agree() for a call that is not a collective (adding or removing a process set,
    making a DistributedOptimizer): on the same exchange, so that a rank still in a
    collective there meets it as a HorovodMismatch on every rank rather than as an MPI
    deadlock. While a rank has joined, the active ranks raise HorovodInternalError (the
    joined ones wait on in join())."""
    key = (call, *(repr(v) for v in fields.values()))
    joined, _ = agree(comm, key, call, lambda: {"call": call, "name": call, **fields}, error)
    if joined:
        raise HorovodInternalError(
            f"fastreduce.horovod: ranks {joined} have joined (hvd.join()); {call} waits until "
            f"every rank has left join()")


def follow(comm: MPI.Intracomm, first: bool):
    """join()'s side of agree(): ("joined", last rank) once every rank has joined, else
    (fields, joined ranks) of the call the other ranks make (fields {"refused": True,
    "name": their name, or None where it differs}: they refused it or differ, and raise)."""
    _raise_if_gone(comm)
    everyone, _ = _exchange(comm, JOINED, int(first))
    _learn_gone(comm, everyone)
    return _slow(comm, JOINED, {"first": first}, None)


def leave(comm: MPI.Intracomm) -> None:
    """shutdown()'s part, collective with the other ranks' next exchange on comm: this
    rank's last status. Ranks waiting in a collective there raise; ranks shutting down too
    carry on."""
    if comm.py2f() not in _gone:
        _exchange(comm, SHUTDOWN, 0)


def forget_gone() -> None:
    """After shutdown(): the communicators are freed, their handles may come again."""
    _gone.clear()


def _gone_error(comm: MPI.Intracomm, gone: list[int]) -> HorovodInternalError:
    return HorovodInternalError(
        f"fastreduce.horovod: {agreement.ranks_text(gone)} of a process set of "
        f"{comm.Get_size()} shut down (hvd.shutdown() or the end of its program) while this "
        f"rank submitted a collective on it: no collective can run on that set any more "
        f"(in Horovod's words, Horovod has been shut down)")


def _raise_if_gone(comm: MPI.Intracomm) -> None:
    gone = _gone.get(comm.py2f())
    if gone:
        raise _gone_error(comm, gone)


def _learn_gone(comm: MPI.Intracomm, everyone: np.ndarray) -> None:
    """Raise (every rank that took part, alike) where a rank sent its shutdown status."""
    gone = np.flatnonzero(everyone[:, 0] == SHUTDOWN).tolist()
    if gone:
        _gone[comm.py2f()] = gone
        raise _gone_error(comm, gone)


def _slow(comm: MPI.Intracomm, status: int, fields: dict, error):
    """The slow path: every rank's full description (a vote of fastreduce.agreement, the
    status its extra), then every active rank raises alike, or learns which ranks joined.
    A joined rank never raises for the active ranks' call: it learns that they refused it
    or differ, and waits on in join()."""
    everyone = comm.allgather(agreement.vote(fields, error, status))
    joined = [r for r, (_, _, s) in enumerate(everyone) if s == JOINED]
    active = [(r, f) for r, (f, _, s) in enumerate(everyone) if s != JOINED]
    descriptions = [f for _, f in active]
    if status == JOINED:
        if not active:
            firsts = [r for r, (f, _, _) in enumerate(everyone) if f["first"]]
            return "joined", max(firsts) if firsts else comm.Get_size() - 1
        refused = any(text is not None for _, text, _ in everyone)
        if refused or agreement.differences(descriptions) is not None:
            names = {f.get("name") for f in descriptions}
            return {"refused": True, "name": names.pop() if len(names) == 1 else None}, joined
        return descriptions[0], joined
    agreement.raise_refusals(everyone, error, lambda ranks, listing: HorovodMismatch(
        f"fastreduce.horovod: {agreement.ranks_text(ranks)} refused the collective, so no "
        f"rank runs it ({listing})"))
    found = agreement.differences(descriptions, [r for r, _ in active])
    if found is not None:
        call = descriptions[0].get("call")
        what = "different collectives" if call is None or "call" in found.fields else \
            f"{call} differently"
        raise HorovodMismatch(
            f"fastreduce.horovod: the ranks of a process set of {comm.Get_size()} submitted "
            f"{what} ({found.text()}); every rank must submit the same "
            f"collectives, with the same names, dtypes, shapes and ops, in the same order")
    return joined
