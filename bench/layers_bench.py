"""Overhead of the partition and autograd layers over the core all-reduce.

    mpiexec -n 4 python bench/layers_bench.py [--repeat 5] [--json FILE]

On a [2, p/2] CartesianPartition ([1, p] for p < 4 or odd),
AllSumReduce(axes_reduce=[1]) sums over the workers of a row. The reference
is the core's out-of-place fastreduce.allreduce on the same group built by
hand (COMM_WORLD.Split by row). Columns, float32, latency in us (average
over ranks, median of runs), ratios taken within each run:

  core          fastreduce.allreduce(x, comm=row_comm)
  layer         AllSumReduce(x), x not requiring grad      (target <= 1.1x core)
  functional    fastreduce.all_sum_reduce(x, P, [1]), no grad
  fwd+bwd       y = AllSumReduce(x); y.backward(g)           (target <= 1.2x reference)
  reference     2 x core + forward+backward of an identity torch.autograd.Function
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch
from mpi4py import MPI

import fastreduce
from fastreduce._abi import first_line
from fastreduce.nn import AllSumReduce


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def timed(comm, fn, iters: int) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    comm.Barrier()
    start = time.perf_counter()
    for _ in itertools.repeat(None, iters):
        fn()
    return (time.perf_counter() - start) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="4,1024,65536,1048576", help="bytes, comma-separated")
    parser.add_argument("--json")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    p = world.size
    shape = [2, p // 2] if p >= 4 and p % 2 == 0 else [1, p]
    P = fastreduce.Partition().create_cartesian_topology_partition(shape)
    row_comm = world.Split(P.coords[0], world.rank)
    layer = AllSumReduce(P, axes_reduce=[1])
    subs_before = len(P._subs)
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        n = max(1, nbytes // 4)
        iters = 2000 if nbytes <= 65536 else 200
        x = torch.rand(n)
        xg = torch.rand(n, requires_grad=True)
        g = torch.rand(n)
        cols = {
            "core": lambda x=x: fastreduce.allreduce(x, comm=row_comm),
            "layer": lambda x=x: layer(x),
            "functional": lambda x=x: fastreduce.all_sum_reduce(x, P, [1]),
            "fwd+bwd": lambda xg=xg, g=g: layer(xg).backward(g),
            "identity fn": lambda xg=xg, g=g: Identity.apply(xg).backward(g),
        }
        samples = {k: [] for k in cols}
        for _ in range(args.repeat):
            for name, fn in cols.items():
                world.Barrier()
                samples[name].append(world.allreduce(timed(world, fn, iters)) / p)
        med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        ratio = {
            "layer / core": statistics.median(
                a / b for a, b in zip(samples["layer"], samples["core"], strict=True)),
            "functional / core": statistics.median(
                a / b for a, b in zip(samples["functional"], samples["core"], strict=True)),
            "fwd+bwd / (2 core + identity fn)": statistics.median(
                a / (2 * b + c) for a, b, c in zip(samples["fwd+bwd"], samples["core"],
                                                   samples["identity fn"], strict=True)),
        }
        rows.append({"bytes": nbytes, "lat_us": med, "ratio": ratio})
    new_comms = len(P._subs) - subs_before
    if world.rank == 0:
        print(f"# fastreduce {fastreduce.__version__} layers benchmark: {p} ranks, partition "
              f"{shape}, AllSumReduce over axis 1 ({shape[1]} workers); "
              f"{first_line(MPI.Get_library_version())}; median of {args.repeat}")
        print(f"{'bytes':>8} {'core':>8} {'layer':>8} {'funct.':>8} {'fwd+bwd':>9} "
              f"{'id.fn':>7} {'layer/core':>10} {'funct/core':>10} {'fwdbwd/ref':>10}")
        for r in rows:
            m, q = r["lat_us"], list(r["ratio"].values())
            print(f"{r['bytes']:>8} {m['core']:8.2f} {m['layer']:8.2f} {m['functional']:8.2f} "
                  f"{m['fwd+bwd']:9.2f} {m['identity fn']:7.2f} {q[0]:10.2f} {q[1]:10.2f} "
                  f"{q[2]:10.2f}")
        print(f"# communicators created by the layer calls after construction: {new_comms}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": p, "rows": rows, "new_comms": new_comms}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
