"""Data-parallel training step: fastreduce against torch DDP, on CPU or GPU.

    mpiexec -n 2 python bench/train_step_bench.py --device cuda          (the GPU model below)
    mpiexec -n 2 python bench/train_step_bench.py --width 256 --depth 4  (a CPU-sized one)

An MLP of `--depth` Linear(width, width)+ReLU layers and a Linear(width, 10) head (the
default, 2048 x 6, has 25.2M parameters), SGD, batch `--batch`, every rank on its own data
(on a GPU: cuda:local_rank % devices; start MPS first when ranks share one). One job
times, alternating, per step in ms (median of `--repeat` runs of `--steps` steps):

  no communication   forward, backward, optimizer step
  GradientSync       fastreduce.GradientSync (bucketed iallreduce_ during backward)
  coalesced          one allreduce_coalesced_ of every gradient after backward
  DDP gloo           torch.nn.parallel.DistributedDataParallel on gloo
  allreduce alone    one allreduce_ of a buffer the size of all gradients (no model)

and the ratios GradientSync / DDP gloo and GradientSync / (no communication + allreduce
alone), each taken within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

import fastreduce
from fastreduce._abi import first_line
from fastreduce.bench import init_gloo


def make_mlp(width: int, depth: int, device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers).to(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = fastreduce.default_comm()
    rank, p = comm.Get_rank(), comm.Get_size()
    if args.device == "cuda":
        torch.cuda.set_device(fastreduce.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        sync = torch.cuda.synchronize
    else:
        device, sync = torch.device("cpu"), (lambda: None)
    init_gloo(MPI.COMM_WORLD)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    x = x.to(device)

    def timed(fn) -> float:
        fn()
        sync()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            fn()
        sync()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX) / args.steps

    def training(model, opt, after_backward=None):
        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            if after_backward is not None:
                after_backward()
            opt.step()
        return step

    plain = make_mlp(args.width, args.depth, device)
    synced = make_mlp(args.width, args.depth, device)
    coalesced = make_mlp(args.width, args.depth, device)
    ddp = torch.nn.parallel.DistributedDataParallel(make_mlp(args.width, args.depth, device))
    gsync = fastreduce.GradientSync(synced)
    variants = {"no communication": training(plain, torch.optim.SGD(plain.parameters(), 1e-3))}
    opt = torch.optim.SGD(synced.parameters(), 1e-3)
    gsync.attach(opt)
    variants["GradientSync"] = training(synced, opt)
    grads = [q for q in coalesced.parameters()]

    def reduce_all():
        fastreduce.allreduce_coalesced_([q.grad for q in grads], "avg")

    variants["coalesced"] = training(coalesced, torch.optim.SGD(coalesced.parameters(), 1e-3),
                                     reduce_all)
    variants["DDP gloo"] = training(ddp, torch.optim.SGD(ddp.parameters(), 1e-3))
    n_params = sum(q.numel() for q in plain.parameters())
    flat = torch.zeros(n_params, device=device)
    variants["allreduce alone"] = lambda: fastreduce.allreduce_(flat)
    samples = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, fn in variants.items():
            samples[name].append(timed(fn) * 1e3)
    med = {k: statistics.median(v) for k, v in samples.items()}
    vs_ddp = statistics.median(a / b for a, b in zip(samples["GradientSync"],
                                                     samples["DDP gloo"], strict=True))
    vs_floor = statistics.median(
        a / (b + c) for a, b, c in zip(samples["GradientSync"], samples["no communication"],
                                       samples["allreduce alone"], strict=True))
    if rank == 0:
        from fastreduce.backend import engine as _engine

        print(f"# fastreduce {fastreduce.__version__} training step: {p} ranks, device "
              f"{args.device}, MLP {args.depth}x{args.width} + head, {n_params} parameters, "
              f"batch {args.batch}; {first_line(MPI.Get_library_version())}; torch "
              f"{torch.__version__}; progress engine {_engine.state()[1]}; median of "
              f"{args.repeat} runs of {args.steps} steps")
        for k, v in med.items():
            print(f"  {k:18s} {v:9.2f} ms")
        print(f"  GradientSync / DDP gloo: {vs_ddp:.2f}")
        print(f"  GradientSync / (no communication + allreduce alone): {vs_floor:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"ms": med, "vs_ddp": vs_ddp, "vs_floor": vs_floor, "ranks": p,
                 "device": args.device, "parameters": n_params}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
