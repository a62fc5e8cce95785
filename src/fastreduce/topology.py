"""The job's nodes as MPI sees them: the shared-memory groups of COMM_WORLD
(MPI_Comm_split_type with MPI_COMM_TYPE_SHARED), each named by the processor name
(MPI_Get_processor_name) of its first rank, and where those names and groups disagree."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from mpi4py import MPI

from . import runtime, watchdog

__all__ = ["Topology", "gather", "summarise"]

SHOWN = 8  # items a summary lists before "... (N more)"


@dataclass(frozen=True)
class Topology:
    """The nodes in order of their first rank: each one's name and world ranks, and the
    disagreements between processor names and shared-memory groups."""

    names: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]
    problems: tuple[str, ...] = ()

    @property
    def nodes(self) -> int:
        """How many nodes (shared-memory groups)."""
        return len(self.names)

    @property
    def ranks_per_node(self) -> list[int]:
        """How many ranks each node has."""
        return [len(r) for r in self.ranks]

    def summary(self) -> str:
        """One line, e.g. "4 ranks on 2 nodes (n0, n1), 2 ranks per node"."""
        counts = self.ranks_per_node
        head = f"{_count(sum(counts), 'rank')} on {_count(self.nodes, 'node')}"
        if len(set(counts)) > 1:
            return f"{head}: {_listed(f'{n} {c}' for n, c in zip(self.names, counts, strict=True))}"
        each = f", {_count(counts[0], 'rank')} per node" if self.nodes > 1 else ""
        return f"{head} ({_listed(self.names)}){each}"

    def listing(self) -> str:
        """Each node's ranks, e.g. "n0: 0-1; n1: 2-3"."""
        return "; ".join(f"{n}: {_ranges(r)}" for n, r in zip(self.names, self.ranks, strict=True))

    def as_dict(self) -> dict:
        """The fields for a JSON record."""
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "node_names": list(self.names), "node_ranks": [list(r) for r in self.ranks],
                "topology_problems": list(self.problems)}


def summarise(per_rank: Sequence[tuple[str, Hashable]]) -> Topology:
    """The Topology from each world rank's (processor name, shared-memory group id)."""
    groups: dict[Hashable, list[int]] = {}
    for rank, (_, group) in enumerate(per_rank):
        groups.setdefault(group, []).append(rank)
    problems = []
    for ranks in groups.values():
        names = dict.fromkeys(per_rank[r][0] for r in ranks)
        if len(names) > 1:
            problems.append(f"ranks {_ranges(ranks)} share memory (one MPI_COMM_TYPE_SHARED "
                            f"group) but have processor names {_listed(names)}")
    for name in dict.fromkeys(n for n, _ in per_rank):
        holding = [r for r in groups.values() if any(per_rank[i][0] == name for i in r)]
        if len(holding) > 1:
            problems.append(f"processor name {name} covers {len(holding)} MPI_COMM_TYPE_SHARED "
                            f"groups: {_listed(f'[{_ranges(r)}]' for r in holding)}")
    return Topology(tuple(per_rank[r[0]][0] for r in groups.values()),
                    tuple(tuple(r) for r in groups.values()), tuple(problems))


@functools.cache
def gather() -> Topology:
    """COMM_WORLD's nodes, the same on every rank (collective on first call, then cached)."""
    world = MPI.COMM_WORLD
    node = runtime._node_comm()
    with watchdog.recorded("MPI_Allgather: the job's nodes", world):
        first = node.bcast(world.Get_rank())
        return summarise(world.allgather((MPI.Get_processor_name(), first)))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _listed(items: Iterable[str]) -> str:
    items = list(items)
    more = f", ... ({len(items) - SHOWN} more)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def _ranges(ranks: Sequence[int]) -> str:
    """Sorted ranks as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return _listed(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
