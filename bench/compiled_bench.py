"""The layers under torch.compile against eager, in one MPI job.

    mpiexec -n 2 python bench/compiled_bench.py [--repeat 5] [--json FILE]

  per call   AllSumReduce over all ranks (no grad), float32, at small and large sizes:
             the core's fastreduce.allreduce, the eager layer, and the layer compiled
             with torch.compile(fullgraph=True) (the fastreduce::all_sum_reduce custom op
             through torch's dispatcher and an inductor graph)
  step       a 4-layer model, Linear -> AllSumReduce -> Linear -> AllSumReduce, forward
             and backward (width x width Linear, batch rows), eager and compiled
             (target: compiled <= 1.0x eager)

Latencies are averages over ranks, medians over runs; ratios are taken within each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import fastreduce
from fastreduce._abi import first_line
from fastreduce.nn import AllSumReduce

sys.path.insert(0, str(Path(__file__).parent))
import layers_bench  # noqa: E402


def timed(comm, fn, iters: int) -> float:
    """Seconds per call, averaged over the ranks."""
    return comm.allreduce(layers_bench.timed(comm, fn, iters)) / comm.Get_size()


class Model(torch.nn.Module):
    def __init__(self, P, width: int):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.r1 = AllSumReduce(P, axes_reduce=[0])
        self.b = torch.nn.Linear(width, width)
        self.r2 = AllSumReduce(P, axes_reduce=[0])

    def forward(self, x):
        return self.r2(self.b(self.r1(self.a(x))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="4,1024,65536,1048576", help="bytes, comma-separated")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = fastreduce.default_comm()
    P = fastreduce.Partition().create_cartesian_topology_partition([world.size])
    layer = AllSumReduce(P, axes_reduce=[0])
    compiled_layer = torch.compile(layer, fullgraph=True)
    results: dict = {"ranks": world.size, "mpi": first_line(MPI.Get_library_version()),
                     "torch": torch.__version__, "per_call": [], "step": {}}

    for nbytes in (int(s) for s in args.sizes.split(",")):
        n = max(1, nbytes // 4)
        iters = 2000 if nbytes <= 65536 else 200
        x = torch.rand(n)
        cols = {"core": lambda x=x: fastreduce.allreduce(x, comm=world),
                "eager layer": lambda x=x: layer(x),
                "compiled layer": lambda x=x: compiled_layer(x)}
        samples = {k: [] for k in cols}
        for _ in range(args.repeat):
            for name, fn in cols.items():
                samples[name].append(timed(world, fn, iters))
        row = {"bytes": nbytes, **{k: statistics.median(v) * 1e6 for k, v in samples.items()}}
        row["compiled / eager"] = statistics.median(
            a / b for a, b in zip(samples["compiled layer"], samples["eager layer"], strict=True))
        row["compiled - eager (us)"] = row["compiled layer"] - row["eager layer"]
        results["per_call"].append(row)

    torch.manual_seed(0)
    model = Model(P, args.width)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(args.batch, args.width,
                    generator=torch.Generator().manual_seed(world.rank))

    def step(m):
        for q in model.parameters():
            q.grad = None
        m(x).square().mean().backward()

    steps = {"eager": lambda: step(model), "compiled": lambda: step(compiled)}
    samples = {k: [] for k in steps}
    for _ in range(args.repeat):
        for name, fn in steps.items():
            samples[name].append(timed(world, fn, 200))
    results["step"] = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    results["step"]["compiled / eager"] = statistics.median(
        a / b for a, b in zip(samples["compiled"], samples["eager"], strict=True))

    if world.rank == 0:
        print(f"# fastreduce {fastreduce.__version__} compiled-layers benchmark: {world.size} "
              f"ranks, {results['mpi']}, torch {torch.__version__}, median of {args.repeat}")
        print(f"{'bytes':>8} {'core':>9} {'eager':>9} {'compiled':>9} {'comp/eager':>10} "
              f"{'extra us':>9}")
        for r in results["per_call"]:
            print(f"{r['bytes']:>8} {r['core']:9.2f} {r['eager layer']:9.2f} "
                  f"{r['compiled layer']:9.2f} {r['compiled / eager']:10.2f} "
                  f"{r['compiled - eager (us)']:9.2f}")
        s = results["step"]
        print(f"step (Linear {args.width} -> AllSumReduce, x2; batch {args.batch}; fwd+bwd): "
              f"eager {s['eager']:.1f} us, compiled {s['compiled']:.1f} us, "
              f"compiled / eager {s['compiled / eager']:.2f} (target <= 1.0)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
