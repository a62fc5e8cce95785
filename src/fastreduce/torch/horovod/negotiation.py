"""The ranks of a process set match their collectives by name, as Horovod's coordinator
does. Every collective a rank submits is a pending Request in the set's queue; a *round*
(collective over the set's communicator) tells every rank what the others have pending,
and the requests pending on every rank run, in the first rank's submission order, on every
rank alike. Ranks may so submit named requests in different orders.

A rank takes part in rounds only in its own calls (there is no background thread). An
asynchronous submission, and poll(), start a round that does not wait (decided by a later
such call once every rank has reached it); a call that waits (a blocking call,
synchronize(), join(), shutdown()) first finishes those of every set, in one order of sets
on every rank, then takes part in one round after another until its request has run. The
fast path is one MPI_Iallgather of 16 bytes per rank (a status and a digest of the call's
kind, name, dtype, shape, op, factors and root): where every rank offered the same one
request, it runs.
Otherwise the ranks' lists of pending (name, digest) are exchanged: a name whose
descriptions differ raises on every rank with the differences; a rank's refusal of its
arguments raises there, and a HorovodMismatch on the ranks that submit that name; ranks
that have called join() take part in the others' reductions with zeros; where every rank
waits and nothing can run, every rank's wait raises rather than hang (and the ranks'
numbering of unnamed calls is set alike again). A rank that shuts down (hvd.shutdown(), or
the end of its program) sends its last status: ranks still in a round on the set learn it
there and raise, and every later collective on the set raises at once, as Horovod's "has
been shut down".

What a round decides from the ranks' answers is matching.py's (pure functions, no MPI);
here are the rounds' exchanges, each process set's state (one _Set per communicator) and
the decisions applied to it."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ... import agreement, watchdog
from ...errors import HorovodInternalError, HorovodMismatch
from . import matching, world
from .matching import Status, decided_alone, join_refusal

__all__ = ["Request", "Status", "agree_call", "count_round", "digest", "drain", "follow",
           "follow_numbering", "forget", "forget_gone", "idle", "in_flight_error",
           "join_refusal", "key_digest", "leave", "named_digest", "next_number", "progress",
           "rounds", "settle_poll", "submit", "wait"]

_MASK = (1 << 62) - 1
_digests: dict = {}
# the rounds' MPI calls in the flight record (FASTREDUCE_TIMEOUT): a rank that never comes
# to a round is seen there
_ROUND = "fastreduce.horovod: a round of the matching by name (MPI_Iallgather)"
_LISTS = "fastreduce.horovod: the ranks' pending lists (MPI_Allgather)"


class Request:
    """A collective this rank submitted: pending until a round runs it on every rank.
    `launch(everyone_blocking)` starts it (everyone_blocking: every rank waits for it at
    once, so it may run blocking); its return value is `result`."""

    __slots__ = ("name", "digest", "describe", "launch", "done", "at_once", "result", "error",
                 "callbacks")

    def __init__(self, name: str, digest: int, describe: Callable[[], dict],
                 launch: Callable[[bool], object]):
        self.name, self.digest, self.describe, self.launch = name, digest, describe, launch
        self.done = False        # launched, or failed
        self.at_once = False     # launched blocking: result is the call's result
        self.result = None
        self.error: BaseException | None = None
        self.callbacks: list[Callable[[Request], object]] = []

    def _finish(self, error: BaseException | None = None, everyone_blocking: bool = False):
        if error is None:
            self.at_once = everyone_blocking
            try:
                self.result = self.launch(everyone_blocking)
            except Exception as exc:  # noqa: BLE001  (raised by the request's waiter)
                error = exc
        self.error, self.done = error, True
        for fn in self.callbacks:
            fn(self)


class _Set:
    """This rank's state on one process set's communicator."""

    __slots__ = ("comm", "order", "queue", "refused", "polling", "gone", "send", "answers",
                 "unnamed")

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        # the set's ranks in the world: the same order of sets on every rank (_finish_polls)
        group = comm.Get_group()
        ranks = list(range(group.Get_size()))
        self.order = tuple(ranks if world.current is None else
                           group.Translate_ranks(ranks, _world_group()))
        group.Free()
        self.queue: dict[str, Request] = {}  # name -> pending request, in submission order
        self.refused: dict[str, str] = {}    # name -> another rank's refusal of it
        # a round in flight that does not wait (an asynchronous submission's, or poll()'s):
        # (MPI request, send and receive buffers, the one request it offers or None)
        self.polling = None
        self.gone: list[int] = []  # the ranks of the set that have shut down
        # a round's exchange: this rank's (status, value) and every rank's, also the array
        # the compiled fast path fills (idle())
        self.send = np.empty(2, np.int64)
        self.answers = np.empty(2 * len(ranks), np.int64)
        # the next number of each kind of unnamed call ("allreduce.noname.3") on the set
        self.unnamed: dict[str, int] = {}


class _Process:
    """This rank's state across its process sets."""

    __slots__ = ("sets", "rounds", "polls", "world_group")

    def __init__(self):
        self.sets: dict[int, _Set] = {}  # comm handle -> the set's state (the one registry)
        self.rounds = 0  # the rounds this rank has taken part in, on any set
        self.polls = 0   # the sets with a round in flight that does not wait
        self.world_group: MPI.Group | None = None  # init()'s world's group, until shutdown()


_process = _Process()


def _set(comm: MPI.Intracomm) -> _Set:
    handle = comm.py2f()
    state = _process.sets.get(handle)
    if state is None:
        state = _process.sets[handle] = _Set(comm)
    return state


def _world_group() -> MPI.Group:
    if _process.world_group is None:
        _process.world_group = world.current.comm.Get_group()
    return _process.world_group


def digest(key: tuple, name: str) -> int:
    """A digest of the call (key: its description but the name), the same on every rank
    (Python's hash() is not)."""
    return named_digest(key_digest(key), name)


def key_digest(key: tuple) -> int:
    """The part of digest() that comes from the key (cached: a caller may keep it)."""
    value = _digests.get(key)
    if value is None:
        if len(_digests) > 4096:
            _digests.clear()
        value = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(),
                               "little")
        _digests[key] = value
    return value


def named_digest(value: int, name: str) -> int:
    """digest() from key_digest()'s value and the name."""
    text = name.encode()  # two 32-bit checksums: names that collide in both are far rarer
    return (value ^ (zlib.crc32(text) | zlib.adler32(text) << 32) * 0x9E3779B1) & _MASK


def _exchange(comm: MPI.Intracomm, state: _Set, status: int, value: int
              ) -> tuple[np.ndarray, bool]:
    """Every rank's (status, value); and whether all sent the same."""
    size = comm.Get_size()
    send, recv = state.send, state.answers
    send[0] = status
    send[1] = value
    # non-blocking and waited for: MPI matches no blocking collective with a non-blocking
    # one, and poll()'s rounds must not wait
    with watchdog.recorded(_ROUND, comm):
        comm.Iallgather(send, recv).Wait()
    return recv.reshape(size, 2), recv.tobytes() == send.tobytes() * size


def idle(comm: MPI.Intracomm, name: str) -> np.ndarray | None:
    """Where this rank has nothing pending on comm's set (no rank of it has shut down, no
    rank refused `name`), the array for every rank's answer to a new blocking request's
    (BLOCKING, digest()), for a compiled call that exchanges them and runs the collective
    where all are the same (then count_round()); else None: the request must be submitted
    (submit() raises what is to be raised before any exchange)."""
    state = _set(comm)
    if state.queue or name in state.refused or state.gone or _process.polls:
        return None
    return state.answers


def count_round() -> None:
    """A round made by a compiled call (after idle())."""
    _process.rounds += 1


def rounds() -> int:
    """How many rounds this rank has taken part in (on any process set)."""
    return _process.rounds


def in_flight_error(name: str) -> ValueError:
    """A second request of a name in flight: this rank's own mistake, as in Horovod, raised
    there at once (the other ranks are not told)."""
    return ValueError(f"fastreduce.horovod: a request named {name!r} is in flight already; "
                      f"synchronize it first or give another name")


def submit(comm: MPI.Intracomm, key: tuple, name: str, describe: Callable[[], dict],
           launch: Callable[[bool], object], error: BaseException | None = None,
           blocking: bool = False, exchanged: np.ndarray | None = None) -> Request:
    """Submit a collective (key: its description but the name; describe(): the full
    description, needed only where ranks differ or have joined) and take part in a round;
    blocking, in rounds until it has run. Its Request (launched, pending, or failed: its
    error raised by whoever waits for it). Raises `error` (this rank's refusal of its
    arguments) after telling the other ranks, and, blocking, the request's own error.
    `exchanged`: every rank's answer to this request's compiled exchange (idle()), which
    differ: the round goes on from there."""
    _raise_if_gone(comm)
    state = _set(comm)
    if blocking or error is not None:  # before this rank's requests are listed again
        _finish_polls()
    if name in state.queue:  # this rank's own mistake: the others are not told
        raise in_flight_error(name)
    if error is not None:
        _round(comm, state, None, None, (name, agreement.refusal(error)))
        raise error
    refusal = state.refused.pop(name, None)
    if refusal is not None:  # another rank refused it already and will not submit it again
        raise HorovodMismatch(refusal)
    request = Request(name, digest(key, name), describe, launch)
    state.queue[name] = request
    if not blocking:  # its waiter raises its error (an asynchronous call's handle)
        _advance(comm, state, False)
        return request
    _round(comm, state, request, request, exchanged=exchanged)
    wait(comm, request)
    return request


def progress(comm: MPI.Intracomm, request: Request) -> None:
    """poll()'s part for a request that has not run: a round that does not wait."""
    if not request.done:
        _advance(comm, _set(comm), True)


def _advance(comm: MPI.Intracomm, state: _Set, settle: bool) -> None:
    """A round that does not wait, for the requests not yet run (at an asynchronous
    submission; at poll(), `settle`): where such a round is in flight on the set and every
    rank has reached it, it is decided (requests may run) where that needs no more
    communication, or `settle`; then, requests still pending, a new one is started
    (MPI_Iallgather). So an asynchronous call never waits for the other ranks: the rank's
    next call that waits (a blocking call, synchronize(), join(), shutdown()) first
    finishes every such round of every set (_finish_polls)."""
    if state.polling is not None:
        exchange, send, recv, offered = state.polling
        if not exchange.Test() or not (settle or decided_alone(recv, send)):
            return
        _finish_poll(comm, state)
    if not state.queue or state.gone:
        return
    # offer the oldest request pending: where every rank offers the same (ranks that submit
    # in one order), it runs without the lists' exchange, one request a round
    offered = next(iter(state.queue.values()))
    send = np.array([Status.ACTIVE, offered.digest], np.int64)
    recv = np.empty(2 * comm.Get_size(), np.int64)
    state.polling = (comm.Iallgather(send, recv), send, recv, offered)
    _process.polls += 1


def _finish_polls() -> None:
    """Finish every round in flight that does not wait, on every set, in the same order of
    sets on every rank (so that no two ranks each wait in one set for the other): before
    any round that waits, as an asynchronous submission's round would have been finished
    before the rank's next call that waits."""
    pending = [state for state in _process.sets.values() if state.polling is not None]
    for state in sorted(pending, key=lambda st: st.order):
        _finish_poll(state.comm, state)


def _finish_poll(comm: MPI.Intracomm, state: _Set) -> None:
    """Complete and settle the round in flight on comm that did not wait, if any (before
    any other)."""
    polling, state.polling = state.polling, None
    if polling is not None:
        _process.polls -= 1
        exchange, send, recv, offered = polling
        with watchdog.recorded(_ROUND, comm):
            exchange.Wait()
        _process.rounds += 1
        _decide(comm, state, recv.reshape(-1, 2), recv.tobytes() == send.tobytes() *
                (recv.size // 2), int(send[0]), int(send[1]), offered, None, None, False)


def wait(comm: MPI.Intracomm, request: Request) -> None:
    """Take part in rounds until `request` has run (or failed: its error raised)."""
    state = _set(comm)
    _finish_polls()
    while not request.done:
        _raise_if_gone(comm)
        _round(comm, state, None, request)
    if request.error is not None:
        raise request.error


def agree_call(comm: MPI.Intracomm, call: str, fields: dict,
               error: BaseException | None = None) -> None:
    """A call that is not a collective (adding or removing a process set, making a
    DistributedOptimizer) submitted as one, blocking: so that a rank still in a collective
    there meets it in the rounds rather than in MPI. While a rank has joined, the active
    ranks raise HorovodInternalError (the joined ones wait on in join())."""
    key = (call, *(repr(v) for v in fields.values()))
    submit(comm, key, call, lambda: {"call": call, "name": call, **fields}, lambda _: None,
           error, blocking=True)


def drain(comm: MPI.Intracomm) -> None:
    """Take part in rounds until this rank has nothing pending on comm's set (join() first
    lets its own requests run with its own data). Their errors are their handles'."""
    state = _set(comm)
    _finish_polls()
    while state.queue:
        _raise_if_gone(comm)
        _round(comm, state, None, next(iter(state.queue.values())))


def settle_poll(comm: MPI.Intracomm) -> None:
    """Finish the rounds in flight that do not wait (before comm's set is removed)."""
    _finish_polls()


def follow(comm: MPI.Intracomm, joined_at: int):
    """join()'s round (joined_at: when this rank called join(), in microseconds): ("joined",
    the last rank to join) once every rank has joined; else (descriptions of the calls this
    rank takes part in, with zeros, in order; the names the active ranks used up, their
    unnamed numbering to follow)."""
    _raise_if_gone(comm)
    state = _set(comm)
    _finish_polls()
    return _round(comm, state, None, None, None, joined_at)


def leave(comms: list[MPI.Intracomm]) -> None:
    """shutdown()'s part, collective with the other ranks' next round on each of comms: this
    rank's last status, sent on every set at once (so that no rank waits to leave one set
    while another waits for it in a round of another). Ranks waiting in a round there
    raise; ranks shutting down too carry on."""
    _finish_polls()
    exchanges, buffers = [], []
    for comm in comms:
        state = _process.sets.get(comm.py2f())
        if state is None or not state.gone:
            send = np.array([Status.SHUTDOWN, 0], np.int64)
            recv = np.empty(2 * comm.Get_size(), np.int64)
            buffers.append((send, recv))
            exchanges.append(comm.Iallgather(send, recv))
    if exchanges:
        with watchdog.recorded(_ROUND, comms[0]):
            MPI.Request.Waitall(exchanges)


def forget(comm: MPI.Intracomm) -> None:
    """comm's process set is removed: its state here goes (the handle may come again)."""
    state = _process.sets.pop(comm.py2f(), None)
    if state is not None and state.polling is not None:  # settled first (settle_poll)
        state.polling = None
        _process.polls -= 1


def forget_gone() -> None:
    """After shutdown(): the communicators are freed, their handles may come again."""
    _process.sets.clear()
    _process.polls = 0
    if _process.world_group is not None:
        _process.world_group.Free()
        _process.world_group = None


def next_number(comm: MPI.Intracomm | None, kind: str) -> int:
    """The number of the next unnamed call of this kind on comm's process set (0 before
    init() or off the set, where the call is refused)."""
    if world.current is None or not comm:
        return 0
    numbers = _set(comm).unnamed
    number = numbers.get(kind, 0)
    numbers[kind] = number + 1
    return number


def follow_numbering(comm: MPI.Intracomm, numbers: dict[str, int]) -> None:
    """Number the next unnamed calls of each kind on comm's set from at least numbers[kind]
    (after calls that other ranks made and this one did not)."""
    if world.current is not None:
        unnamed = _set(comm).unnamed
        for kind, number in numbers.items():
            unnamed[kind] = max(unnamed.get(kind, 0), number)


def _gone_error(comm: MPI.Intracomm, gone: list[int]) -> HorovodInternalError:
    return HorovodInternalError(
        f"fastreduce.horovod: {agreement.ranks_text(gone)} of a process set of "
        f"{comm.Get_size()} shut down (hvd.shutdown() or the end of its program) while this "
        f"rank submitted a collective on it: no collective can run on that set any more "
        f"(in Horovod's words, Horovod has been shut down)")


def _raise_if_gone(comm: MPI.Intracomm) -> None:
    state = _process.sets.get(comm.py2f())
    if state is not None and state.gone:
        raise _gone_error(comm, state.gone)


def _learn_gone(comm: MPI.Intracomm, state: _Set, statuses: np.ndarray) -> None:
    """Raise (every rank that took part, alike) where a rank sent its shutdown status."""
    gone = np.flatnonzero(statuses == Status.SHUTDOWN).tolist()
    if gone:
        state.gone = gone
        raise _gone_error(comm, gone)


def _round(comm: MPI.Intracomm, state: _Set, fresh: Request | None,
           waiting: Request | None, refusal: tuple | None = None, joined_at: int | None = None,
           exchanged: np.ndarray | None = None):
    """One round (collective over comm): runs or fails the requests it settles. `fresh`:
    the request just submitted; `waiting`: the one this rank waits for; `refusal`: (name,
    why) this rank refuses; `joined_at` (join() only: when this rank called it);
    `exchanged`: the exchange of this round made already (idle()). For join(),
    follow()'s result."""
    joining = joined_at is not None
    queue = state.queue
    if joining:
        status, value = Status.JOINED, joined_at
    elif refusal is not None:
        status, value = Status.REFUSED, 0
    elif fresh is not None and len(queue) == 1:
        status, value = (Status.BLOCKING if waiting is fresh else Status.ACTIVE), fresh.digest
    else:
        status, value = Status.LISTED, 0
    _process.rounds += 1
    if exchanged is None:
        everyone, alike = _exchange(comm, state, status, value)
    else:
        everyone, alike = exchanged.reshape(-1, 2), False
    return _decide(comm, state, everyone, alike, status, value, fresh, waiting, refusal,
                   joining)


def _decide(comm: MPI.Intracomm, state: _Set, everyone: np.ndarray, alike: bool, status: int,
            value: int, fresh: Request | None, waiting: Request | None, refusal: tuple | None,
            joining: bool):
    """A round once its exchange is made: every rank's (status, value) in `everyone`
    (this rank's own: status, value), `alike` where all are the same."""
    queue = state.queue
    statuses = everyone[:, 0]
    if alike and status in (Status.ACTIVE, Status.BLOCKING):
        del queue[fresh.name]
        fresh._finish(None, status == Status.BLOCKING)
        return None
    _learn_gone(comm, state, statuses)
    if (statuses == Status.JOINED).all():
        # the rank that called join() last (by the clocks of the ranks' hosts)
        return "joined", max(range(len(statuses)), key=lambda r: (int(everyone[r, 1]), r))
    if matching.all_offer(statuses, everyone[:, 1], status, value):
        del queue[fresh.name]  # some wait at once, some later: all take the non-blocking path
        fresh._finish()
        return None
    return _settle(comm, state, waiting, refusal, joining)


def _settle(comm: MPI.Intracomm, state: _Set, waiting: Request | None,
            refusal: tuple | None, joining: bool):
    """A round's slow path: every rank's pending list, then the same decisions on every
    rank (matching.decide: the requests to run, in the first active rank's order; the
    names that differ, were refused, or can never run), applied here."""
    queue = state.queue
    # a matching.Record, sent as a plain tuple (the smaller pickle)
    record = (joining, None if waiting is None else waiting.name,
              [(n, r.digest) for n, r in queue.items()], refusal)
    with watchdog.recorded(_LISTS, comm):
        everyone = comm.allgather(record)
    decision = matching.decide(everyone)
    for name, text in decision.refused.items():
        if joining:
            continue
        request = queue.pop(name, None)
        if request is not None:
            request._finish(HorovodMismatch(text))
        elif refusal is None or refusal[0] != name:
            if len(state.refused) > 4096:
                state.refused.clear()
            state.refused[name] = text
    described: list[dict] = []
    if decision.wanted:
        with watchdog.recorded(_LISTS, comm):
            described = comm.allgather({} if joining else
                                       {n: queue[n].describe() for n in decision.wanted})
    active = decision.active
    for name in decision.differ:
        found = agreement.differences([described[r][name] for r in active], active)
        error = HorovodMismatch(matching.mismatch_text(
            name, comm.Get_size(), described[active[0]][name].get("call"), found))
        if not joining:
            queue.pop(name)._finish(error)
    take_part = []
    if decision.joined:
        for name, fields, error in matching.join_parts(decision, described):
            if joining:
                if error is None:
                    take_part.append(fields)
            else:  # runs where the joined take part (error None), else fails
                queue.pop(name)._finish(error)
    else:
        for name in decision.runnable:
            queue.pop(name)._finish()
    if decision.stuck:
        _unstick(comm, state, waiting, everyone, decision)
    if joining:
        return take_part, decision.runnable + decision.differ + list(decision.refused)
    return None


def _unstick(comm: MPI.Intracomm, state: _Set, waiting: Request | None, everyone: list,
             decision: matching.Decision) -> None:
    """Every active rank waits for a request that some rank has not submitted: none can
    ever run, so each rank's wait raises (none may be left waiting: a rank whose program
    then meets the others outside fastreduce would hang). Then the ranks' numbering of
    unnamed calls is set alike: each kind's next number the highest any rank has used or
    holds pending, so that their next unnamed calls match again."""
    if waiting is not None and comm.Get_rank() in decision.active:
        state.queue.pop(waiting.name, None)
        waiting._finish(HorovodMismatch(
            matching.stuck_text(everyone, decision.active, comm.Get_size())))
    numbers = matching.unused_numbering(state.unnamed if world.current is not None else {},
                                        list(state.queue))
    with watchdog.recorded(_LISTS, comm):
        numbered = comm.allgather(numbers)
    follow_numbering(comm, matching.highest_numbering(numbered))
