"""Data-parallel training step: fastreduce against torch DDP, on CPU or GPU.

    mpiexec -n 2 python bench/train_step_bench.py --device cuda          (the GPU model below)
    mpiexec -n 2 python bench/train_step_bench.py --width 256 --depth 4  (a CPU-sized one)

An MLP of `--depth` Linear(width, width)+ReLU layers and a Linear(width, 10) head (the
default, 2048 x 6, has 25.2M parameters), SGD, batch `--batch`, every rank on its own data
(on a GPU: cuda:local_rank % devices; start MPS first when ranks share one). One job
times, alternating, per step in ms (median of `--repeat` runs of `--steps` steps):

  no communication   forward, backward, optimizer step
  backward, allreduce  the same, with one allreduce_ of a buffer the size of all gradients
                     between backward and the step: the serial schedule done by hand (the
                     ranks wait for each other every step, as any data-parallel step does)
  GradientSync       fastreduce.GradientSync (the bucket engine; --schedule, default auto)
  hvd                fastreduce.horovod's DistributedOptimizer (the same engine, negotiated)
  DDP fastreduce     DistributedDataParallel on fastreduce's torch.distributed backend
  DDP gloo           DistributedDataParallel on gloo
  allreduce alone    one allreduce_ of a buffer the size of all gradients (no model)

and the ratios GradientSync / (no communication + allreduce alone), GradientSync /
(backward, allreduce) (the serial floor measured as a step), hvd / GradientSync,
DDP fastreduce / GradientSync and GradientSync / DDP gloo, each taken within a run. The
schedule each one chose (and the serial schedule's form: in place or flat), and what
"auto" measured, are printed. `--timeline PATH` writes GradientSync's Chrome trace.
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
import fastreduce.distributed  # noqa: F401  (registers the torch.distributed backend)
import fastreduce.horovod as hvd
from fastreduce._abi import first_line


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
    parser.add_argument("--schedule", choices=("auto", "overlap", "serial"), default=None,
                        help="GradientSync's schedule (default: FASTREDUCE_GRADIENT_SCHEDULE)")
    parser.add_argument("--timeline", help="GradientSync's Chrome trace ({rank} allowed)")
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
    dist.init_process_group("fastreduce")
    gloo = dist.new_group(backend="gloo")
    hvd.init()
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

    def model() -> torch.nn.Module:
        return make_mlp(args.width, args.depth, device)

    plain, serial, synced, horovod = model(), model(), model(), model()
    n_params = sum(q.numel() for q in plain.parameters())
    flat = torch.zeros(n_params, device=device)
    gsync = fastreduce.GradientSync(synced, schedule=args.schedule, timeline=args.timeline)
    opt = torch.optim.SGD(synced.parameters(), 1e-3)
    gsync.attach(opt)
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(horovod.parameters(), 1e-3),
                                       named_parameters=horovod.named_parameters())
    ddp_fr = torch.nn.parallel.DistributedDataParallel(model())
    ddp_gloo = torch.nn.parallel.DistributedDataParallel(model(), process_group=gloo)
    variants = {
        "no communication": training(plain, torch.optim.SGD(plain.parameters(), 1e-3)),
        "backward, allreduce": training(serial, torch.optim.SGD(serial.parameters(), 1e-3),
                                        lambda: fastreduce.allreduce_(flat)),
        "GradientSync": training(synced, opt),
        "hvd": training(horovod, hvd_opt),
        "DDP fastreduce": training(ddp_fr, torch.optim.SGD(ddp_fr.parameters(), 1e-3)),
        "DDP gloo": training(ddp_gloo, torch.optim.SGD(ddp_gloo.parameters(), 1e-3)),
    }
    variants["allreduce alone"] = lambda: fastreduce.allreduce_(flat)
    samples = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, fn in variants.items():
            samples[name].append(timed(fn) * 1e3)
    med = {k: statistics.median(v) for k, v in samples.items()}

    def ratio(a: str, *b: str) -> float:
        return statistics.median(x / sum(y) for x, *y in zip(
            samples[a], *(samples[n] for n in b), strict=True))

    ratios = {"GradientSync / (no communication + allreduce alone)":
              ratio("GradientSync", "no communication", "allreduce alone"),
              "GradientSync / (backward, allreduce)": ratio("GradientSync",
                                                            "backward, allreduce"),
              "hvd / GradientSync": ratio("hvd", "GradientSync"),
              "DDP fastreduce / GradientSync": ratio("DDP fastreduce", "GradientSync"),
              "GradientSync / DDP gloo": ratio("GradientSync", "DDP gloo")}
    ddp_buckets = getattr(dist.group.WORLD, "_buckets", None)  # the backend is the group

    def chosen(chooser) -> tuple[str, dict]:
        """The schedule (with the serial form where there are two) and what was measured."""
        forms = getattr(chooser, "serial_forms", {})
        mode = chooser.mode if chooser.mode == "overlap" or not forms else \
            f"{chooser.mode}, {chooser.form}"
        return mode, {**chooser.measured, **{f"serial {k}": v for k, v in forms.items()}}

    schedules = {"GradientSync": chosen(gsync._engine.chooser),
                 "hvd": chosen(hvd_opt._hvd_engine.chooser),
                 "DDP fastreduce": chosen(ddp_buckets.chooser)
                 if ddp_buckets is not None else ("not used", {})}
    if rank == 0:
        from fastreduce.backend import engine as _engine

        print(f"# fastreduce {fastreduce.__version__} training step: {p} ranks, device "
              f"{args.device}, MLP {args.depth}x{args.width} + head, {n_params} parameters, "
              f"batch {args.batch}; {first_line(MPI.Get_library_version())}; torch "
              f"{torch.__version__}; progress engine {_engine.state()[1]}; median of "
              f"{args.repeat} runs of {args.steps} steps")
        for k, v in med.items():
            print(f"  {k:18s} {v:9.2f} ms")
        for k, v in ratios.items():
            print(f"  {k}: {v:.3f}")
        for k, (mode, measured) in schedules.items():
            told = ", ".join(f"{m} {t * 1e3 / p:.1f} ms" for m, t in measured.items())
            print(f"  {k} schedule: {mode}" + (f" (measured per rank: {told})" if told else ""))
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"ms": med, "ratios": ratios, "schedules": schedules, "ranks": p,
                 "device": args.device, "parameters": n_params,
                 "mpi": first_line(MPI.Get_library_version())}, indent=1))
    gsync.remove()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
