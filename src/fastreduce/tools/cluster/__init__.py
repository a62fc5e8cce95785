"""A cluster on one machine: nodes as network namespaces on a bridge, links shaped with
tc, MPI jobs (Open MPI or MPICH) launched across them with ranks placed and checked.

    python -m fastreduce.cluster up --nodes 3 --link 1gbit
    python -m fastreduce.cluster run -n 6 -- python train.py
    python -m fastreduce.cluster down

Needs root (network namespaces), iproute2 and util-linux.
"""

from .cli import build_parser, main
from .manager import Cluster, remove
from .network import Link, Node

__all__ = ["Cluster", "Link", "Node", "build_parser", "main", "remove"]
