"""Agreement between ranks before a collective, so that disagreement raises everywhere.

A collective that the ranks of a communicator call with different arguments is undefined
in MPI: it may return wrong data, hang, or crash the process (Open MPI's MPI_Cart_sub
with different remain_dims dies of SIGFPE). `agree()` exchanges a small description of
the call first, with one MPI_Allgather (in debug mode a watched MPI_Iallgather, see
set_debug), and every rank raises the same CollectiveMismatch when the descriptions
differ, or when any rank refused its arguments (the votes and their comparison are
`fastreduce.agreement`'s; what is checks' own is the call's description, debug mode's
watched exchange and the deadlock reports).
"""

from __future__ import annotations

import pickle
import struct
import time

from mpi4py import MPI

from . import agreement, settings, watchdog
from .agreement import ranks_text
from .backend import collectives
from .errors import CollectiveMismatch

__all__ = ["CollectiveMismatch", "agree", "debug", "fingerprint", "set_debug"]


def agree(comm: MPI.Comm, what: str, fields: dict, error: BaseException | None = None) -> None:
    """Collective over comm: every rank passes the same `what` and `fields`, and no rank an
    `error` (its own validation failure, raised here on that rank after the exchange so the
    others are not left waiting). Otherwise every rank raises: the refusing ranks their own
    error, the others CollectiveMismatch."""
    mine = agreement.vote({"call": what, **fields}, error)
    with watchdog.recorded(f"agreement on {what} (MPI_Allgather)", comm):
        if _debug and _channel is not None:  # wait where a deadlock can be seen
            everyone = _gather_watching(comm, mine, what, fields)
            if everyone is None:  # every rank sent the same bytes
                if error is None:
                    return
                everyone = [mine] * comm.Get_size()  # every rank refused alike
        else:
            everyone = comm.allgather(mine)
    agreement.settle(everyone, error, refused=lambda ranks, listing: CollectiveMismatch(
        f"fastreduce: {what}: {ranks_text(ranks)} refused the call, so no rank makes it "
        f"({listing})"), differ=lambda found: _mismatch(comm, what, found))


def _mismatch(comm: MPI.Comm, what: str, found: agreement.Differences) -> CollectiveMismatch:
    # the same text on every rank: name the call only where every rank made it
    called = "made different calls" if "call" in found.fields else f"called {what} differently"
    return CollectiveMismatch(
        f"fastreduce: the ranks of a communicator of {comm.Get_size()} {called} "
        f"({found.text()}); every rank must make the same collective calls in the same "
        f"order with the same arguments", found.fields)


# --- debug mode ---------------------------------------------------------------------------

_debug = False
_sequence_keyval: int | None = None
# Debug mode's side channel (a duplicate of COMM_WORLD): a rank that has waited in a check
# for `_report_after` seconds tells every rank where it waits, so that ranks waiting on
# different communicators for each other (collectives issued in different orders) see it.
_channel: MPI.Intracomm | None = None
_report_after = 10.0
_STATE_TAG = 0x5EED
_GRACE = 1.0  # seconds the picture must stay unchanged before a deadlock is declared
_peers: dict[int, tuple | None] = {}  # world rank -> where it waits (None: it moved on)
_decided: set[int] = set()  # ranks that raised for the deadlock they last reported
_sends: list = []
# The exchanges of checks this rank gave up on (a deadlock raised): MPI still owns their
# buffers, so they are kept for good; and this rank says it moved on at its next check.
_abandoned: list = []


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{name}={text!r}: give a number of seconds > 0")
    return value


def set_debug(on: bool | None, *, report_after: float | None = None) -> bool:
    """Debug mode on or off (None: as FASTREDUCE_DEBUG says); returns the previous setting.

    In debug mode every collective fastreduce issues (allreduce in every form, coalesced,
    GradientSync's buckets, the layers, the torch.distributed backend, partition set-up) is
    preceded by a check on its communicator in which the ranks compare a fingerprint: a
    per-communicator sequence number, the call, element count, dtype, op and device. Any
    difference raises CollectiveMismatch on every rank instead of a hang, a crash or wrong
    data. A rank that waits in a check for `report_after` seconds (FASTREDUCE_DEBUG_WAIT,
    default 10) tells the others where it waits; ranks that wait for each other in checks
    on different communicators (collectives issued in different orders) then all raise
    CollectiveMismatch. Every rank must use the same setting: turning it on the first time
    is collective over COMM_WORLD (it duplicates COMM_WORLD for those reports)."""
    global _debug, _channel, _report_after
    old = _debug
    if on is None:
        on = settings.value("FASTREDUCE_DEBUG")
    if report_after is not None:
        _report_after = _seconds("report_after", str(report_after))
    elif (wait := settings.value("FASTREDUCE_DEBUG_WAIT")) is not None:
        _report_after = wait
    if on and _channel is None:
        _channel = MPI.COMM_WORLD.Dup()
        _channel.Set_name("fastreduce debug reports")
    _debug = bool(on)
    collectives.set_debug_hook(fingerprint if _debug else None)
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


def fingerprint(comm: MPI.Comm, call: str, *, pairwise=None, **fields) -> None:
    """Debug mode: the ranks of comm agree on this call (see set_debug); pairwise, for an
    uneven all-to-all: (send counts, receive counts), which must match between each pair
    of ranks."""
    agree(comm, call, {"sequence number": _next_sequence(comm), **fields})
    if pairwise is not None:
        rows = comm.allgather(pairwise)
        mismatches = split_mismatches(rows)
        if mismatches:
            raise CollectiveMismatch(
                f"fastreduce: {call}: the ranks' counts do not pair up: "
                + "; ".join(f"rank {i} sends {sent} elements to rank {j}, which expects "
                            f"{expected}" for i, j, sent, expected in mismatches[:8])
                + (f"; and {len(mismatches) - 8} more" if len(mismatches) > 8 else "")
                + "; give each rank's receive counts as the senders' send counts",
                {"counts": {(i, j): (sent, expected) for i, j, sent, expected in mismatches}})


def split_mismatches(rows: list) -> list[tuple[int, int, int, int]]:
    """(i, j, what rank i sends to j, what rank j expects from i) for each pair that
    differs, from every rank's (send counts, receive counts)."""
    n = len(rows)
    return [(i, j, rows[i][0][j], rows[j][1][i]) for i in range(n) for j in range(n)
            if rows[i][0][j] != rows[j][1][i]]


# --- debug mode: collectives issued in different orders on different communicators ----------

_SLOT = 256  # bytes per rank in the non-blocking exchange; longer descriptions take two steps


def _gather_watching(comm: MPI.Comm, mine: tuple, what: str, fields: dict) -> list | None:
    """comm.allgather(mine), non-blocking, with _await's watch while the others arrive;
    None when every rank passed the same bytes (the common case, decoded no further)."""
    data = pickle.dumps(mine)
    slot = bytearray(_SLOT)
    struct.pack_into("<q", slot, 0, len(data))
    if len(data) <= _SLOT - 8:
        slot[8:8 + len(data)] = data
    size = comm.Get_size()
    gathered = bytearray(_SLOT * size)
    if _abandoned and _peers.get(_channel.Get_rank()) is not None:
        _announce(None)  # the program went on after a deadlock was raised here
    _receive_reports()  # reports sent while this rank was not waiting: keep the queue short
    request = comm.Iallgather([slot, MPI.BYTE], [gathered, MPI.BYTE])
    try:
        _await(request, comm, what, fields)
    except CollectiveMismatch:
        _abandoned.append((request, slot, gathered))
        raise
    if len(data) <= _SLOT - 8 and gathered == slot * size:
        return None
    slots = [gathered[i:i + _SLOT] for i in range(0, len(gathered), _SLOT)]
    lengths = [struct.unpack_from("<q", one)[0] for one in slots]
    if max(lengths) > _SLOT - 8:  # every rank sees this and takes the second step
        return comm.allgather(mine)
    return [pickle.loads(one[8:8 + n]) for one, n in zip(slots, lengths, strict=True)]


def _await(request: MPI.Request, comm: MPI.Comm, what: str, fields: dict) -> None:
    """Complete request (a check's exchange on comm), raising CollectiveMismatch when the
    ranks wait for each other in checks on different communicators, which no amount of
    waiting resolves."""
    if request.Test():
        return
    started = time.monotonic()
    while not request.Test():
        waited = time.monotonic() - started
        if waited > _report_after:
            break
        if waited > 0.01:  # spin first (checks usually complete in microseconds), then nap
            time.sleep(min(waited / 10, 1e-3))
    else:
        return
    me = _where_i_wait(comm, what, fields)
    _announce(me)
    stable_since, seen = None, None
    while not request.Test():
        _receive_reports()
        blocked = _blocked_closure(me)
        if blocked is None or blocked != seen:
            stable_since, seen = time.monotonic(), blocked
        elif time.monotonic() - stable_since > _GRACE:
            _leave(me, blocked)
            raise CollectiveMismatch(_deadlock_text(blocked), {"waiting": blocked})
        time.sleep(0.01)
    _announce(None)


def _leave(me: tuple, blocked: dict[int, tuple]) -> None:
    """Before raising for a deadlock: say so, and once every rank of it has said so too,
    say this rank moved on (so a program that goes on is not taken for waiting). Should
    that not happen soon, the report stays "waiting" until this rank's next check: the
    others may still need it to decide."""
    _announce(me, decided=True)
    deadline = time.monotonic() + 5 * _GRACE
    while time.monotonic() < deadline:
        _receive_reports()
        if all(rank in _decided for rank in blocked):
            _announce(None)
            return
        time.sleep(0.01)


def _where_i_wait(comm: MPI.Comm, what: str, fields: dict) -> tuple:
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        members = tuple(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()
    detail = ", ".join(f"{k} {v}" for k, v in fields.items())
    return (what, detail, comm.Get_name(), members)


def _announce(state: tuple | None, decided: bool = False) -> None:
    """Tell every other rank where this rank waits (None: it no longer waits; decided: it
    raised for the deadlock it waits in)."""
    assert _channel is not None
    me = _channel.Get_rank()
    _record(me, state, decided)
    _sends[:] = [r for r in _sends if not r.Test()]
    _sends.extend(_channel.isend((state, decided), dest=r, tag=_STATE_TAG)
                  for r in range(_channel.Get_size()) if r != me)


def _record(rank: int, state: tuple | None, decided: bool) -> None:
    _peers[rank] = state
    if decided:
        _decided.add(rank)
    elif state is not None:  # waiting anew
        _decided.discard(rank)


def _receive_reports() -> bool:
    """Take in the other ranks' reports; whether any arrived."""
    assert _channel is not None
    status = MPI.Status()
    changed = False
    while (message := _channel.improbe(source=MPI.ANY_SOURCE, tag=_STATE_TAG,
                                       status=status)) is not None:
        _record(status.Get_source(), *message.recv())
        changed = True
    return changed


def _blocked_closure(me: tuple) -> dict[int, tuple] | None:
    """The ranks this rank waits for, the ranks they wait for, and so on, if every one of
    them waits in a check (then none of those checks can complete); else None."""
    waiting = dict(_peers)
    start = MPI.COMM_WORLD.Get_rank()
    waiting[start] = me
    seen: dict[int, tuple] = {}
    todo = [start]
    while todo:
        rank = todo.pop()
        if rank in seen:
            continue
        state = waiting.get(rank)
        if state is None:
            return None  # that rank is running: it may still arrive
        seen[rank] = state
        todo.extend(state[3])
    return dict(sorted(seen.items()))


def _members_text(members: tuple) -> str:
    ranks = list(members)
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ranks_text(ranks)


def _deadlock_text(blocked: dict[int, tuple]) -> str:
    by_place: dict[tuple, list[int]] = {}
    for rank, state in blocked.items():
        by_place.setdefault(state, []).append(rank)
    places = "; ".join(
        f"{ranks_text(ranks)} wait{'s' if len(ranks) == 1 else ''} in {what} ({detail}) on "
        f"{repr(name) + ' ' if name else 'a communicator '}of {_members_text(members)}"
        for (what, detail, name, members), ranks in by_place.items())
    return (f"fastreduce: collectives that can never complete: {places}; each of these ranks "
            f"waits for ranks that wait in another collective. Every rank must call the "
            f"collectives of communicators it shares with others in the same order. The "
            f"communicators involved are unusable now: end the job")
