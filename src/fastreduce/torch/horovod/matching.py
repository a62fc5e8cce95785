"""What a round of the matching by name decides, from what every rank sent: no MPI here
(negotiation.py makes the exchanges and applies the decision), so every rank, given the
same records, decides the same, and the rules are tested without a job.

A round's fast path compares each rank's (status, digest) (`all_offer`, `decided_alone`).
Its slow path gathers each rank's `Record`; `decide` says which names were refused, which
differ between the ranks, which can run (in the first active rank's order) and whether
every active rank waits in vain; `mismatch_text`, `join_parts` and `stuck_text` finish
the decision from the described fields the ranks exchange where it needs them."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ...errors import HorovodInternalError


class Status(enum.IntEnum):
    """A rank's status in a round, sent as an int64 beside a value (the values are the
    wire's: every rank of a job must agree on them)."""

    ACTIVE = 0     # offers its oldest pending request (value: its digest), waits later
    JOINED = 1     # in join() (value: when it called join(), in microseconds)
    REFUSED = 2    # refuses its own call's arguments
    BLOCKING = 4   # offers its one pending request and waits for it at once
    SHUTDOWN = 8   # shut down: its last status on the set
    LISTED = 16    # its pending list differs from "one new request": the lists are exchanged


class Record(NamedTuple):
    """What one rank sends on a round's slow path."""

    joined: bool                          # in join()
    waiting: str | None                   # the name it waits for, if it waits
    pending: list[tuple[str, int]]        # its pending (name, digest), in submission order
    refusal: tuple[str, str] | None       # (name, why) of the call it refuses


@dataclass(frozen=True)
class Decision:
    """A slow-path round's decision, the same on every rank that gathered the same
    records."""

    joined: list[int]         # the ranks in join()
    active: list[int]         # the others
    refused: dict[str, str]   # name -> the error text of its refusal (the first rank's)
    differ: list[str]         # pending on every active rank, described differently
    runnable: list[str]       # pending on every active rank alike, in the first one's order
    stuck: bool               # every active rank waits and nothing can run

    @property
    def wanted(self) -> list[str]:
        """The names whose full descriptions the ranks must exchange: those that differ
        (for the error's text) and, where ranks have joined, those that run (what the
        joined take part in)."""
        return self.differ + (self.runnable if self.joined else [])


def all_offer(statuses: np.ndarray, values: np.ndarray, status: int, value: int) -> bool:
    """Whether this rank (status, value) and every other offered the same one request (some
    to wait for it at once, some later)."""
    return status in (Status.ACTIVE, Status.BLOCKING) and bool(
        ((statuses == Status.ACTIVE) | (statuses == Status.BLOCKING)).all() and
        (values == value).all())


def decided_alone(recv: np.ndarray, send: np.ndarray) -> bool:
    """Whether a round's answers (every rank's status and value, interleaved) decide it
    without the lists' exchange: every rank offered the same one request, or some rank shut
    down (the round raises)."""
    statuses, values = recv[0::2], recv[1::2]
    return all_offer(statuses, values, int(send[0]), int(send[1])) or \
        bool((statuses == Status.SHUTDOWN).any())


def refusal_text(rank: int, name: str, why: str) -> str:
    """The error of a collective that `rank` refused (`why`: its own error's text)."""
    return (f"fastreduce.horovod: rank {rank} refused the collective {name!r}, so no rank "
            f"runs it ({why})")


def decide(records: Sequence[Record]) -> Decision:
    """The slow path's decision from every rank's record, in rank order."""
    joined = [r for r, record in enumerate(records) if record[0]]
    active = [r for r, record in enumerate(records) if not record[0]]
    refused: dict[str, str] = {}
    for r, record in enumerate(records):
        if record[3] is not None:
            name, why = record[3]
            refused.setdefault(name, refusal_text(r, name, why))
    lists = [dict(records[r][2]) for r in active]
    first = lists[0] if lists else {}
    # a name runs where every active rank has it pending (a joined rank has nothing
    # pending: join() ran its own requests first)
    common = [n for n in first if n not in refused and all(n in lst for lst in lists[1:])]
    differ = [n for n in common if any(lst[n] != first[n] for lst in lists[1:])]
    runnable = [n for n in common if n not in differ]
    stuck = not (runnable or differ or refused) and \
        all(records[r][1] is not None for r in active)
    return Decision(joined, active, refused, differ, runnable, stuck)


def mismatch_text(name: str, set_size: int, call: Any, found: Any) -> str:
    """The error of a name the active ranks described differently: `call`, the first
    active rank's kind of call; `found`, agreement.differences() of their descriptions
    (None where they differ in nothing the description holds)."""
    what = "different collectives" if found is None or "call" in found.fields else \
        f"{call} differently"
    return (f"fastreduce.horovod: the ranks of a process set of {set_size} submitted {what} "
            f"under the name {name!r} ({found.text() if found else ''}); every rank must "
            f"submit the same collective, with the same dtype, shape and op, under one name")


def join_refusal(fields: dict, joined: list) -> HorovodInternalError | None:
    """What the active ranks raise for a call that ranks which have joined cannot take part
    in, as Horovod: only reductions (hvd.Average and hvd.Sum: the joined give zeros) and
    barriers can run then. The joined ranks stay in join()."""
    call, why = fields["call"], None
    if call == "bucket":
        if fields["op"] not in ("avg", "sum"):
            why = "DistributedOptimizer's reductions with hvd.Average or hvd.Sum"
    elif call in ("allreduce", "grouped_allreduce"):
        if fields["op"] not in ("Average", "Sum"):
            why = f"an allreduce with hvd.Average or hvd.Sum only, not {fields['op']}"
    elif call != "barrier":
        why = f"allreduce (hvd.Average, hvd.Sum) and barrier only, not {call}"
    if why is None:
        return None
    return HorovodInternalError(f"fastreduce.horovod: ranks {joined} have joined (hvd.join()); "
                                f"they take part in {why}: {fields['name']!r} is refused")


def join_parts(decision: Decision, described: Sequence[dict]
               ) -> list[tuple[str, dict, HorovodInternalError | None]]:
    """Where ranks have joined: for each runnable name, in order, its description (the
    first active rank's: what the joined take part in) and the error the active ranks
    raise instead where the joined cannot take part (join_refusal)."""
    parts = []
    for name in decision.runnable:
        fields = described[decision.active[0]][name]
        parts.append((name, fields, join_refusal(fields, decision.joined)))
    return parts


def stuck_text(records: Sequence[Record], active: Sequence[int], set_size: int) -> str:
    """The error of every active rank's wait where none can run (Decision.stuck)."""
    listing = "; ".join(f"rank {r} waits for {records[r][1]!r} (pending: "
                        f"{', '.join(repr(n) for n, _ in records[r][2])})" for r in active)
    return (f"fastreduce.horovod: every rank of a process set of {set_size} waits for a "
            f"call (collective) that another rank has not submitted, so none can run "
            f"({listing}); every rank must submit the same calls, matched by name")


# an unnamed call's name (kind, number), with a grouped or sparse call's part after it
_UNNAMED = re.compile(r"^(.*?)\.noname\.(\d+)(?:\.|$)")


def unnamed_number(name: str) -> tuple[str | None, int]:
    """(kind, number) of an unnamed call's name; (None, 0) for a name given by the user."""
    found = _UNNAMED.match(name)
    return (found[1], int(found[2])) if found else (None, 0)


def unused_numbering(numbers: dict[str, int], pending: Sequence[str]) -> dict[str, int]:
    """This rank's next number of each kind of unnamed call (`numbers`), lowered to the
    lowest number it holds pending: that call is still to be made by the others."""
    numbers = dict(numbers)
    for name in pending:
        kind, number = unnamed_number(name)
        if kind is not None and number < numbers.get(kind, number + 1):
            numbers[kind] = number
    return numbers


def highest_numbering(numbered: Sequence[dict[str, int]]) -> dict[str, int]:
    """Each kind's highest next number over the ranks' numberings."""
    highest: dict[str, int] = {}
    for theirs in numbered:
        for kind, number in theirs.items():
            highest[kind] = max(highest.get(kind, 0), number)
    return highest
