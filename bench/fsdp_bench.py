"""FSDP2 (`fully_shard`) training step on a fastreduce group against the same on gloo.

    mpiexec -n 2 python bench/fsdp_bench.py [--width 1024] [--depth 4] [--repeat 5]

An MLP of `--depth` Linear(width, width)+ReLU layers, each layer and the model sharded with
`fully_shard` over a device mesh of the group (FSDP2's all-gather of parameters before
forward and backward, reduce-scatter of gradients after backward), SGD, batch `--batch`,
every rank on its own data. One job times both groups, alternating within each repeat
(the order rotating between repeats); per step in ms, medians of `--repeat` runs of
`--steps` steps (timed with the benchmark tool's harness), and the ratio fastreduce / gloo
taken within each run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from mpi4py import MPI

import fastreduce.distributed  # noqa: F401  (registers the backend)
from fastreduce.tools.benchmark.timing import _time


def make_model(width: int, depth: int, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    from torch.distributed.device_mesh import DeviceMesh

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    dist.init_process_group("fastreduce")
    groups = {"fastreduce": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    runs = {}
    for name, group in groups.items():
        model, opt = make_model(args.width, args.depth, DeviceMesh.from_group(group, "cpu"))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.randn(args.batch, 10, generator=g)

        def step(model=model, opt=opt, x=x, y=y):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        runs[name] = step
    times: dict[str, list[float]] = {name: [] for name in runs}
    ratios = []
    names = list(runs)
    for r in range(args.repeat):
        order = names[r % 2:] + names[:r % 2]
        this = {}
        for name in order:
            seconds = _time(comm, runs[name], args.steps, 2)
            this[name] = comm.allreduce(seconds, op=MPI.MAX) * 1e3  # the slowest rank's
        for name in names:
            times[name].append(this[name])
        ratios.append(this["fastreduce"] / this["gloo"])
    if rank == 0:
        params = sum(p.numel() for p in torch.nn.Linear(args.width, args.width).parameters())
        print(f"Measured {time.strftime('%Y-%m-%d')} on {platform.node()} "
              f"({platform.machine()}), {comm.Get_size()} ranks; "
              f"{MPI.Get_library_version().splitlines()[0]}; torch {torch.__version__}; "
              f"MLP {args.depth} x {args.width} (+ head), {params * args.depth / 1e6:.1f}M "
              f"parameters, batch {args.batch}; step time = the slowest rank's mean over "
              f"{args.steps} steps, median of {args.repeat} runs")
        print()
        print("| group | FSDP2 step (ms) |")
        print("|---|---:|")
        for name in names:
            print(f"| {name} | {statistics.median(times[name]):.2f} |")
        print(f"\nfastreduce / gloo (within each run, median): {statistics.median(ratios):.2f} "
              f"(runs: {', '.join(f'{v:.2f}' for v in ratios)})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
