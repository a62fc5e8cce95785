"""``python -m fastreduce.cluster``: up, run, status, shape, link, down."""

from __future__ import annotations

import argparse
import sys

from ...errors import ClusterError
from . import launch
from .manager import DEFAULT_NAME, DEFAULT_SUBNET, Cluster, remove

__all__ = ["build_parser", "main"]

EXAMPLES = """\
examples (as root):
  python -m fastreduce.cluster up --nodes 2 --link 1gbit
  python -m fastreduce.cluster run -n 4 -- python -m fastreduce.bench
  python -m fastreduce.cluster run -n 4 --per-node 1 ... (4 nodes needed: an error here)
  python -m fastreduce.cluster link n1 down       (pull node n1's cable)
  python -m fastreduce.cluster down
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="python -m fastreduce.cluster", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Several nodes on one machine: network namespaces on a bridge, links "
                    "shaped with tc, MPI jobs launched across them (Open MPI or MPICH).")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=DEFAULT_NAME,
                        help="the cluster's name: its devices and nodes are NAME-br, NAME-n0, "
                             f"... (default {DEFAULT_NAME})")
    sub = parser.add_subparsers(dest="action", required=True)

    def add(action: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(action, help=text, parents=[common])

    up = add("up", "make the nodes")
    up.add_argument("--nodes", type=int, default=2, help="how many nodes (default 2)")
    up.add_argument("--link", default=None,
                    help="each node's link to the switch: RATE[,DELAY[,LOSS%%]] as tc writes "
                         "them, e.g. 1gbit or 10gbit,50us (default: unshaped)")
    up.add_argument("--no-hosts", action="store_true",
                    help="each node resolves only its own name (as on clusters where names "
                         "resolve only on a management network)")
    up.add_argument("--subnet", default=DEFAULT_SUBNET,
                    help=f"the nodes' network (default {DEFAULT_SUBNET})")
    run = add("run", "run an MPI job across the nodes")
    run.add_argument("-n", type=int, required=True, dest="nprocs", help="ranks")
    run.add_argument("--per-node", type=int, default=None,
                     help="ranks per node, nodes filled in turn (default: ceil(n / nodes))")
    run.add_argument("--mpiexec", default=None,
                     help="the MPI launcher (default: the one beside this Python, else PATH's)")
    run.add_argument("--no-check", action="store_true",
                     help="skip the placement check before the job")
    run.add_argument("--timeout", type=float, default=None,
                     help="seconds before the job and whatever it left on the nodes is killed")
    run.add_argument("--dry-run", action="store_true", help="print the mpiexec line only")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- the command to run")
    add("status", "the nodes and the link")
    shape = add("shape", "shape every node's link anew")
    shape.add_argument("link", help="RATE[,DELAY[,LOSS%%]], or 'unshaped'")
    link = add("link", "take one node's link down or bring it up")
    link.add_argument("node", help="node name (NAME-n1) or index (1)")
    link.add_argument("state", choices=["up", "down"])
    add("down", "kill the jobs and remove everything the cluster made")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ClusterError as exc:
        print(exc, file=sys.stderr)
        return 1


def _dispatch(args) -> int:
    if args.action == "up":
        cluster = Cluster.up(args.nodes, args.link, args.name, args.subnet, not args.no_hosts)
        print(cluster.describe())
        return 0
    if args.action == "down":
        removed = remove(args.name)
        print(f"removed {', '.join(removed)}" if removed else f"no cluster {args.name} was up")
        return 0
    cluster = Cluster.attach(args.name)
    if args.action == "status":
        print(cluster.describe())
    elif args.action == "shape":
        cluster.shape(args.link)
        print(cluster.describe())
    elif args.action == "link":
        node = cluster.node(int(args.node) if args.node.isdigit() else args.node)
        cluster.set_link(node.name, args.state == "up")
        print(f"{node.name}: link {args.state}")
    elif args.action == "run":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            raise ClusterError("fastreduce.cluster run: no command; give it after --")
        cmd, _, _ = cluster.command(args.nprocs, argv, args.per_node, args.mpiexec)
        if args.dry_run:
            print(launch.shell_line(cmd))
            return 0
        if not args.no_check:
            report = cluster.check_placement(args.nprocs, args.per_node, args.mpiexec)
            print(report.strip().splitlines()[-1], file=sys.stderr)
        rc, _ = cluster.run(args.nprocs, argv, args.per_node, args.mpiexec,
                            timeout=args.timeout)
        return rc
    return 0
