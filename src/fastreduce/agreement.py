"""Agreement between the ranks of a communicator, written once for every caller.

Whatever decides the MPI calls a rank makes (a collective's arguments, the settings that
pick an all-reduce algorithm or a GPU path) must be the same on every rank of the
communicator, or the ranks make different calls: wrong data, a hang or a crash. So such a
collective starts with an agreement: each rank contributes a *vote*, its *fields* (a dict
of what it would do) or its *refusal* (its own validation error), and after one
MPI_Allgather every rank holds every vote and raises alike:

- some rank refused: the refusing ranks raise their own error, the others the caller's
  exception naming those ranks and their reasons (`raise_refusals`);
- the fields differ: every rank raises the caller's exception, made from the same
  `Differences` (which ranks gave which value of each field that differs).

`agree` does the exchange and both steps. A caller that exchanges in its own way (debug
mode's watched exchange in `fastreduce.checks`, the node count that `fastreduce.algorithms`
gathers with the settings) hands the gathered votes to `settle`; the Horovod negotiation,
whose fast path compares digests, uses `raise_refusals` and `differences` on its slow path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from . import watchdog

__all__ = ["Differences", "agree", "differences", "raise_refusals", "ranks_text", "refusal",
           "settle", "vote"]


def ranks_text(ranks: Sequence[int], most: int | None = None) -> str:
    """"rank 3" or "ranks 0, 2" (the first `most` of them, then "...")."""
    shown = list(ranks if most is None else ranks[:most])
    more = "..." if most is not None and len(ranks) > most else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, shown)) + more


def refusal(error: BaseException | None) -> str | None:
    """How a rank's refusal travels to the others."""
    return None if error is None else f"{type(error).__name__}: {error}"


def vote(fields: Any, error: BaseException | None = None, extra: Any = None) -> tuple:
    """One rank's contribution to an agreement: its fields, its refusal (or None) and what
    it tells the others without comparing it (`extra`)."""
    return (fields, refusal(error), extra)


def raise_refusals(votes: Sequence[tuple], error: BaseException | None,
                   refused: Callable[[list[int], str], BaseException]) -> None:
    """Nothing if no vote is a refusal; else this rank's own `error`, or, on the ranks that
    did not refuse, refused(the refusing ranks, "rank 1: ValueError: ...; rank 3: ...")."""
    refusing = [(rank, text) for rank, (_, text, _) in enumerate(votes) if text is not None]
    if not refusing:
        return
    if error is not None:
        raise error
    listing = "; ".join(f"rank {rank}: {text}" for rank, text in refusing)
    raise refused([rank for rank, _ in refusing], listing)


@dataclass(frozen=True)
class Differences:
    """How the ranks' fields differ (the same on every rank that compared the same votes).

    `fields`: for each field that differs, in the order the fields first appear, each
    value's repr and the ranks that gave it; `groups`: the ranks by their fields as a
    whole, each group's fields with its ranks, in rank order.
    """

    fields: dict[str, dict[str, list[int]]]
    groups: list[tuple[Any, list[int]]]

    def text(self, verb: str = "passed") -> str:
        """Field by field: "count: rank 0 passed 7, ranks 1, 2 passed 5; dtype: ..."."""
        return "; ".join(
            f"{key}: " + ", ".join(f"{ranks_text(ranks)} {verb} {value}"
                                   for value, ranks in by_value.items())
            for key, by_value in self.fields.items())

    def by_rank(self, describe: Callable[[Any], str], most: int = 8) -> str:
        """Group by group: "ranks 0, 1: <describe(their fields)>; rank 2: ..."."""
        return "; ".join(f"{ranks_text(ranks, most)}: {describe(fields)}"
                         for fields, ranks in self.groups)


def differences(fields: Sequence[dict], ranks: Sequence[int] | None = None
                ) -> Differences | None:
    """None if every entry of `fields` (one dict per rank, `ranks` naming them: by default
    0, 1, ...) is the same; else how they differ. A field a rank lacks is "<missing>"."""
    if all(f == fields[0] for f in fields):
        return None
    names = list(range(len(fields)) if ranks is None else ranks)
    keys = list(dict.fromkeys(k for f in fields for k in f))
    by_field: dict[str, dict[str, list[int]]] = {}
    for key in keys:
        values = [f.get(key, "<missing>") for f in fields]
        if any(v != values[0] for v in values):
            grouped: dict[str, list[int]] = {}
            for rank, value in zip(names, values, strict=True):
                grouped.setdefault(repr(value), []).append(rank)
            by_field[key] = grouped
    groups: dict[str, tuple[Any, list[int]]] = {}
    for rank, f in zip(names, fields, strict=True):
        groups.setdefault(repr(f), (f, []))[1].append(rank)
    return Differences(by_field, list(groups.values()))


def settle(votes: Sequence[tuple], error: BaseException | None, *,
           refused: Callable[[list[int], str], BaseException],
           differ: Callable[[Differences], BaseException]) -> None:
    """After the exchange of every rank's vote(): return if no rank refused and every rank
    gave the same fields; else raise on every rank (see raise_refusals; differ(how the
    fields differ) where they differ)."""
    raise_refusals(votes, error, refused)
    found = differences([fields for fields, _, _ in votes])
    if found is not None:
        raise differ(found)


def agree(comm: MPI.Comm, fields: dict, error: BaseException | None = None, *,
          refused: Callable[[list[int], str], BaseException],
          differ: Callable[[Differences], BaseException],
          extra: Any = None, doing: str = "agreement") -> list:
    """Collective over comm: exchange every rank's vote(fields, error, extra) with one
    MPI_Allgather (in the flight record as `doing`) and settle() it; every rank's extra."""
    with watchdog.recorded(f"{doing} (MPI_Allgather)", comm):
        votes = comm.allgather(vote(fields, error, extra))
    settle(votes, error, refused=refused, differ=differ)
    return [x for _, _, x in votes]
