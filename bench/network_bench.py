"""The algorithms across two nodes over a 1 Gbit/s link: all-reduce and training steps.

    .venv-openmpi/bin/python bench/network_bench.py [--mpis openmpi,mpich] [--link 1gbit]

Needs root. On a 2-node cluster of this machine (fastreduce.cluster, name "frn"), per MPI
venv: bench/allreduce_bench.py from 1 MiB to 64 MiB on 2 nodes x 1 rank and 2 nodes x 2
ranks, with FASTREDUCE_ALGORITHM=mpi (the MPI library's call, as before the algorithms)
and auto (fastreduce's choice), gloo in the same jobs; then bench/gradsync_bench.py
--network on 2 nodes x 1 rank (GradientSync with and without bf16 compression against DDP
on gloo, with and without a bf16 compression hook). Output and JSON in bench/results/.
--tcp-links N gives Open MPI N TCP connections per peer (OMPI_MCA_btl_tcp_links): one
connection carrying both directions is held to about half the link (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from fastreduce.cluster import Cluster, remove

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
LAYOUTS = {"2x1": (2, 1), "2x2": (4, 2)}


def run(cluster, mpi: str, nprocs: int, per_node: int, argv: list[str], env: dict,
        label: str, timeout: float) -> None:
    venv = ROOT / f".venv-{mpi}"
    mpiexec, python = str(venv / "bin" / "mpiexec"), str(venv / "bin" / "python")
    cluster.check_placement(nprocs, per_node, mpiexec=mpiexec, python=python)
    start = time.monotonic()
    rc, text = cluster.run(nprocs, [python, *argv], per_node, mpiexec=mpiexec,
                           env={**os.environ, **env},
                           timeout=timeout, capture=True)
    print(f"== {label}: status {rc}, {time.monotonic() - start:.0f} s", flush=True)
    print("\n".join(line for line in text.splitlines() if "measured" not in line), flush=True)
    (RESULTS / f"network-{label}.txt").write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mpis", default="openmpi,mpich")
    parser.add_argument("--link", default="1gbit", help="a rate (1gbit), or unshaped")
    parser.add_argument("--layouts", default="2x1,2x2")
    parser.add_argument("--algorithms", default="mpi,auto")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", action=argparse.BooleanOptionalAction, default=True,
                        help="also the training steps (gradsync_bench.py --network)")
    parser.add_argument("--timeout", type=float, default=900, help="per job, seconds")
    parser.add_argument("--bucket-mb", default="25", help="GradientSync's bucket size")
    parser.add_argument("--tcp-links", type=int, default=0,
                        help="Open MPI's TCP connections per peer (OMPI_MCA_btl_tcp_links; "
                             "0: the MPI's default, 1)")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = {"OMPI_MCA_btl_tcp_links": str(args.tcp_links)} if args.tcp_links else {}
    link = args.link + (f"-links{args.tcp_links}" if args.tcp_links else "")
    remove("frn")
    cluster = Cluster.up(2, link=None if args.link == "unshaped" else args.link, name="frn",
                         subnet="10.77.96.0/24")
    try:
        for mpi in args.mpis.split(","):
            for layout in filter(None, args.layouts.split(",")):
                nprocs, per_node = LAYOUTS[layout]
                for algorithm in args.algorithms.split(","):
                    label = f"{mpi}-{layout}-{link}-{algorithm}"
                    run(cluster, mpi, nprocs, per_node,
                        [str(HERE / "allreduce_bench.py"), "-b", "1M", "-e", "64M", "--gloo",
                         "--columns", "fr_ torch,gloo", "--repeat", str(args.repeat),
                         "--max-seconds", "2", "--json", str(RESULTS / f"network-{label}.json")],
                        {**base, "FASTREDUCE_ALGORITHM": algorithm}, label, args.timeout)
            if args.steps:
                label = f"{mpi}-2x1-{link}-steps"
                run(cluster, mpi, 2, 1,
                    [str(HERE / "gradsync_bench.py"), "--network", "--repeat",
                     str(args.repeat), "--bucket-mb", args.bucket_mb,
                     "--json", str(RESULTS / f"network-{label}.json")],
                    base, label, args.timeout)
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
