"""Soak and leak check: resident memory before and after long runs of each kind of call.

    mpiexec -n 2 python bench/soak_bench.py [--scale 1.0] [--json FILE]

  partitions    5000 x (a 2-d CartesianPartition, an AllSumReduce over it, one forward),
                each dropped: MPICH has about 2048 communicators, so a leak ends the run
  allreduce_    100k in-place calls of 4 floats
  allreduce     10k out-of-place calls of 64 Ki floats (the result cache)
  iallreduce_   10k non-blocking calls of 64 Ki floats (the progress engine)
  GradientSync  1k training steps of a small MLP

RSS growth per phase is printed (max over ranks, KiB), after a warm-up of the same calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys

import torch
from mpi4py import MPI

import fastreduce
from fastreduce._abi import first_line
from fastreduce.nn import AllSumReduce


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every count")
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = fastreduce.default_comm()
    p = comm.Get_size()

    def n(count: int) -> int:
        return max(1, int(count * args.scale))

    def partitions(k):
        for _ in range(k):
            P = fastreduce.Partition().create_cartesian_topology_partition([p, 1])
            AllSumReduce(P, axes_reduce=[0])(torch.ones(4))

    small, big = torch.ones(4), torch.ones(64 << 10)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    sync = fastreduce.GradientSync(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sync.attach(opt)
    x = torch.randn(16, 64)

    def steps(k):
        for _ in range(k):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    def repeat(call):
        def run(k):
            for _ in range(k):
                call()  # the result is dropped at once
        return run

    phases = {
        "partitions": (partitions, n(5000)),
        "allreduce_": (repeat(lambda: fastreduce.allreduce_(small)), n(100_000)),
        "allreduce": (repeat(lambda: fastreduce.allreduce(big)), n(10_000)),
        "iallreduce_": (repeat(lambda: fastreduce.iallreduce_(big).wait()), n(10_000)),
        "GradientSync": (steps, n(1000)),
    }
    results = {}
    for name, (fn, count) in phases.items():
        fn(max(1, count // 10))  # warm-up: caches, pools, lazy imports
        gc.collect()
        comm.Barrier()
        before = rss_kib()
        fn(count)
        gc.collect()
        comm.Barrier()
        growth = comm.allreduce(rss_kib() - before, op=MPI.MAX)
        results[name] = {"calls": count, "rss_growth_kib": growth}
    if comm.Get_rank() == 0:
        print(f"# fastreduce {fastreduce.__version__} soak: {p} ranks, "
              f"{first_line(MPI.Get_library_version())}")
        for name, r in results.items():
            print(f"{name:14s} {r['calls']:>8} calls  RSS growth {r['rss_growth_kib']:>7} KiB "
                  f"(max over ranks)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
