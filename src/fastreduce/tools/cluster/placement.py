"""Where the ranks landed, checked as MPI sees it: run on the ranks of a cluster job.

    python -m fastreduce.tools.cluster.placement NODE NODE ...   (one node name per rank)

Each rank reports its hostname and its `MPI_Comm_split_type(SHARED)` group; rank 0
prints the table and every rank exits 1 when a rank is not on the node it was meant
for, or when MPI's shared-memory groups are not the nodes (MPI would then move bytes
between "nodes" through shared memory, and nothing measured would be across a network).
"""

from __future__ import annotations

import socket
import sys

__all__ = ["check", "main"]


def check(expected: list[str], seen: list[tuple[str, int]]) -> list[str]:
    """What is wrong, given each rank's expected node and (hostname, shared group id)."""
    problems = []
    if len(seen) != len(expected):
        return [f"{len(seen)} ranks ran, {len(expected)} were placed"]
    for rank, (node, (host, _)) in enumerate(zip(expected, seen, strict=True)):
        if host != node:
            problems.append(f"rank {rank} runs on {host}, placed on {node}")
    groups: dict[int, set[str]] = {}
    for node, (_, group) in zip(expected, seen, strict=True):
        groups.setdefault(group, set()).add(node)
    for nodes in groups.values():
        if len(nodes) > 1:
            problems.append(f"one shared-memory group spans nodes {sorted(nodes)}")
    by_node: dict[str, set[int]] = {}
    for node, (_, group) in zip(expected, seen, strict=True):
        by_node.setdefault(node, set()).add(group)
    for node, node_groups in by_node.items():
        if len(node_groups) > 1:
            problems.append(f"node {node} holds {len(node_groups)} shared-memory groups")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Report and check this job's placement; 0 when it is as expected."""
    from mpi4py import MPI

    expected = list(sys.argv[1:] if argv is None else argv)
    world = MPI.COMM_WORLD
    shared = world.Split_type(MPI.COMM_TYPE_SHARED)
    group = shared.allreduce(world.Get_rank(), op=MPI.MIN)  # the node's lowest rank
    local = (shared.Get_rank(), shared.Get_size())
    shared.Free()
    seen = world.gather((socket.gethostname(), group, MPI.Get_processor_name(), local), root=0)
    problems = None
    if world.Get_rank() == 0:
        for rank, (host, grp, processor, (local_rank, local_size)) in enumerate(seen):
            print(f"rank {rank}: host {host} (processor {processor}), node-local rank "
                  f"{local_rank} of {local_size}, shared-memory group of rank {grp}")
        problems = check(expected, [(host, grp) for host, grp, _, _ in seen])
        for problem in problems:
            print(f"fastreduce.cluster: placement wrong: {problem}", file=sys.stderr)
        if not problems:
            nodes = sorted({host for host, *_ in seen}, key=[h for h, *_ in seen].index)
            print(f"placement ok: {len(seen)} ranks on {len(nodes)} nodes, each node one "
                  f"shared-memory group")
    problems = world.bcast(problems, root=0)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
