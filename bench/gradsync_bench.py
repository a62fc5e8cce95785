"""Coalesced all-reduce, GradientSync training steps and compute/communication overlap.

    mpiexec -n 2 python bench/gradsync_bench.py [--repeat 5] [--json FILE]

Everything is measured in one MPI job, alternating the variants, and every
ratio is taken within a run (median over runs):

  coalesced     allreduce_coalesced_ of 100 float32 tensors of 1..1000 elements,
                against 100 separate fastreduce.allreduce_ calls
  step          one SGD training step of an MLP with 100 parameter tensors and
                ~10M parameters: no communication; GradientSync; torch
                DistributedDataParallel on gloo and on fastreduce's torch.distributed
                backend (with and without the progress engine, i.e. with and without
                overlap of bucket reductions with backward); and the C floor's time for
                one MPI_Allreduce of all gradients (bench/floor.c)
  overlap       a matmul loop and an iallreduce_ of 16 MiB, back to back against
                started together (with and without test() calls between the
                compute chunks, the progress GradientSync's hooks provide)

By default non-blocking host requests of 64 KiB and more run on fastreduce's progress
engine (a thread making blocking, segmented MPI calls); the "no engine" variants keep every
request on MPI_Iallreduce (FASTREDUCE_ENGINE_HOST_BYTES=off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import fastreduce
import fastreduce.distributed  # noqa: F401  (registers the torch.distributed backend)
from fastreduce._abi import first_line
from fastreduce.backend import engine as _engine

sys.path.insert(0, str(Path(__file__).parent))
from allreduce_bench import load_floor  # noqa: E402


def make_mlp(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def timed(comm, fn, iters: int) -> float:
    fn()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    comm.Barrier()
    return (time.perf_counter() - start) / iters


def sgd_steps(models: dict, x, prepare=None) -> dict:
    """Name -> one SGD step of that model on x. prepare(name, model, optimizer) may attach
    the optimizer or return another one to use instead."""
    steps = {}
    for name, model in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if prepare is not None:
            opt = prepare(name, model, opt) or opt

        def step(model=model, opt=opt):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        steps[name] = step
    return steps


def sample_steps(comm, steps: dict, repeat: int, iters: int, extra=None) -> dict:
    """Name -> seconds per step of each run: the variants alternated `repeat` times, so
    that a slow phase of the machine falls on all of them; extra() -> {name: seconds}
    is sampled in the same rounds."""
    samples: dict = {name: [] for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            samples[name].append(timed(comm, step, iters))
        for name, seconds in (extra() if extra else {}).items():
            samples.setdefault(name, []).append(seconds)
    return samples


def ddp_bucket_timeline(args, x) -> list[dict]:
    """When each DDP bucket's all-reduce on the fastreduce backend started and finished,
    in ms from the start of backward (median over steps): buckets that finish before the
    last one starts were reduced while backward was still computing."""
    model = torch.nn.parallel.DistributedDataParallel(make_mlp(args.width, args.depth))
    world = dist.get_world_size()
    events: list[tuple[int, float, float]] = []

    def hook(state, bucket):
        start = time.perf_counter()
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

        def done(f):
            events.append((bucket.index(), start, time.perf_counter()))
            return f.value()[0].div_(world)

        return fut.then(done)

    model.register_comm_hook(None, hook)
    per_step = []
    for _ in range(args.steps + 1):
        events.clear()
        loss = model(x).square().mean()
        t0 = time.perf_counter()
        loss.backward()
        per_step.append([(i, (a - t0) * 1e3, (b - t0) * 1e3) for i, a, b in sorted(events)])
    per_step = per_step[1:]  # the first step builds the buckets
    out = []
    for k in range(len(per_step[0])):
        out.append({"bucket": per_step[0][k][0],
                    "start_ms": statistics.median(s[k][1] for s in per_step),
                    "done_ms": statistics.median(s[k][2] for s in per_step)})
    return out


def cast_hook(dtype):
    """A DDP comm hook for the CPU (torch's bf16/fp16_compress_hook refuse to register
    without CUDA and NCCL): the bucket cast to dtype, averaged on `group`, cast back."""

    def hook(group, bucket):
        buffer = bucket.buffer()
        half = buffer.to(dtype).div_(dist.get_world_size(group))
        fut = dist.all_reduce(half, group=group, async_op=True).get_future()

        def decompress(f):
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(decompress)

    return hook


bf16_hook = cast_hook(torch.bfloat16)


def network_steps(args, comm, floor, results) -> int:
    """--network: no communication, GradientSync (float32, bf16), DDP on gloo (float32, the
    bf16_compress_hook), DDP on fastreduce and the C floor, alternated; medians and ratios."""
    dist.init_process_group("fastreduce")
    gloo = dist.new_group(backend="gloo")
    models = {name: make_mlp(args.width, args.depth) for name in (
        "no communication", "GradientSync", "GradientSync bf16")}
    models["DDP gloo"] = torch.nn.parallel.DistributedDataParallel(
        make_mlp(args.width, args.depth), process_group=gloo)
    models["DDP gloo bf16 hook"] = torch.nn.parallel.DistributedDataParallel(
        make_mlp(args.width, args.depth), process_group=gloo)
    models["DDP gloo bf16 hook"].register_comm_hook(gloo, bf16_hook)
    models["DDP fastreduce"] = torch.nn.parallel.DistributedDataParallel(
        make_mlp(args.width, args.depth))
    syncs = {"GradientSync": fastreduce.GradientSync(models["GradientSync"],
                                                     bucket_mb=args.bucket_mb),
             "GradientSync bf16": fastreduce.GradientSync(models["GradientSync bf16"],
                                                          bucket_mb=args.bucket_mb,
                                                          compression="bf16")}
    n_params = sum(q.numel() for q in models["no communication"].parameters())
    grads = np.zeros(n_params, np.float32)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(comm.rank))
    steps = sgd_steps(models, x, lambda name, _, opt: syncs[name].attach(opt)
                      if name in syncs else None)
    samples = sample_steps(comm, steps, args.repeat, args.steps, lambda: {
        "C floor allreduce": floor.floor_allreduce(comm.py2f(), None, grads.ctypes.data,
                                                   n_params, 1, 3)})
    results["step_ms"] = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    results["ratios"] = {
        f"{a} / {b}": statistics.median(x / y for x, y in zip(samples[a], samples[b],
                                                               strict=True))
        for a, b in (("GradientSync", "DDP gloo"), ("DDP fastreduce", "GradientSync"),
                     ("GradientSync bf16", "DDP gloo"),
                     ("GradientSync bf16", "DDP gloo bf16 hook"))}
    results["parameters"] = n_params
    results["buckets"] = syncs["GradientSync"].bucket_sizes
    dist.destroy_process_group()
    if comm.rank == 0:
        print(f"# fastreduce {fastreduce.__version__} training steps: {comm.size} ranks, "
              f"{results['mpi']}, {n_params} parameters, median of {args.repeat} runs")
        for k, v in results["step_ms"].items():
            print(f"  {k:24s} {v:9.2f} ms")
        for k, v in results["ratios"].items():
            print(f"  {k:40s} {v:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--width", type=int, default=448)
    parser.add_argument("--depth", type=int, default=50, help="Linear layers (2 tensors each)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--json")
    parser.add_argument("--bucket-mb", type=float, default=25,
                        help="GradientSync's bucket size with --network")
    parser.add_argument("--network", action="store_true",
                        help="training steps only, with 16-bit compression variants "
                             "(GradientSync bf16, DDP gloo with bf16_compress_hook): for "
                             "runs across nodes")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank on the 2-core machine
    comm = fastreduce.default_comm()
    p, rank = comm.size, comm.rank
    floor = load_floor(comm)
    results: dict = {"ranks": p, "mpi": first_line(MPI.Get_library_version())}

    if args.network:
        return network_steps(args, comm, floor, results)

    # --- coalesced ------------------------------------------------------------------
    rng = np.random.default_rng(rank)
    tensors = [torch.from_numpy(rng.random(int(n), dtype=np.float32))
               for n in np.random.default_rng(7).integers(1, 1001, 100)]

    def separate():
        for t in tensors:
            fastreduce.allreduce_(t)

    coalesced = {"separate": [], "coalesced": []}
    for _ in range(args.repeat):
        coalesced["separate"].append(timed(comm, separate, 50))
        coalesced["coalesced"].append(
            timed(comm, lambda: fastreduce.allreduce_coalesced_(tensors), 50))
    speedup = statistics.median(
        a / b for a, b in zip(coalesced["separate"], coalesced["coalesced"], strict=True))
    results["coalesced"] = {k: statistics.median(v) * 1e6 for k, v in coalesced.items()}
    results["coalesced"]["speedup"] = speedup

    # --- training step ----------------------------------------------------------------
    dist.init_process_group("fastreduce")  # rank, size and rendezvous from MPI
    gloo = dist.new_group(backend="gloo")
    plain = make_mlp(args.width, args.depth)
    synced = make_mlp(args.width, args.depth)
    ddp_model = torch.nn.parallel.DistributedDataParallel(make_mlp(args.width, args.depth),
                                                          process_group=gloo)
    ddp_fastreduce = torch.nn.parallel.DistributedDataParallel(
        make_mlp(args.width, args.depth), process_group=dist.group.WORLD)
    # gradient_as_bucket_view: gradients live in the buckets, no copy in and out
    ddp_gloo_view = torch.nn.parallel.DistributedDataParallel(
        make_mlp(args.width, args.depth), process_group=gloo, gradient_as_bucket_view=True)
    ddp_fastreduce_view = torch.nn.parallel.DistributedDataParallel(
        make_mlp(args.width, args.depth), gradient_as_bucket_view=True)
    sync = fastreduce.GradientSync(synced)
    n_tensors = sum(1 for _ in plain.parameters())
    n_params = sum(q.numel() for q in plain.parameters())
    grads = np.zeros(n_params, np.float32)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    variants = {}
    steps = sgd_steps({"no communication": plain, "GradientSync": synced,
                       "DDP gloo": ddp_model, "DDP fastreduce": ddp_fastreduce,
                       "DDP gloo, view": ddp_gloo_view,
                       "DDP fastreduce, view": ddp_fastreduce_view}, x,
                      lambda name, _, opt: sync.attach(opt) if name == "GradientSync" else None)
    for name, step in steps.items():
        variants[name] = step
        if name in ("GradientSync", "DDP fastreduce", "DDP fastreduce, view") and \
                _engine.state()[0]:
            def no_engine_step(step=step):
                _engine.set_host(False)
                try:
                    step()
                finally:
                    _engine.set_host(None)

            variants[f"{name}, no engine"] = no_engine_step
    samples = sample_steps(comm, variants, args.repeat, args.steps, lambda: {
        "C floor allreduce": floor.floor_allreduce(comm.py2f(), None, grads.ctypes.data,
                                                   n_params, 1, 3)})
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    vs_ddp = statistics.median(a / b for a, b in zip(samples["GradientSync"],
                                                     samples["DDP gloo"], strict=True))
    vs_floor = statistics.median(
        a / (b + c) for a, b, c in zip(samples["GradientSync"], samples["no communication"],
                                       samples["C floor allreduce"], strict=True))
    ratio = {}
    for a_name, b_name in (("DDP fastreduce", "DDP gloo"), ("DDP fastreduce", "GradientSync"),
                           ("DDP fastreduce", "DDP fastreduce, no engine"),
                           ("DDP fastreduce, no engine", "DDP gloo"),
                           ("DDP fastreduce, no engine", "GradientSync"),
                           ("DDP fastreduce, view", "DDP gloo, view"),
                           ("DDP fastreduce, view, no engine", "DDP gloo, view")):
        if a_name in samples and b_name in samples:
            ratio[f"{a_name} / {b_name}"] = statistics.median(
                a / b for a, b in zip(samples[a_name], samples[b_name], strict=True))
    results["step_ms"] = med
    results["step"] = {"tensors": n_tensors, "parameters": n_params, "batch": args.batch,
                       "GradientSync / DDP gloo": vs_ddp,
                       "GradientSync / (no comm + C floor)": vs_floor,
                       "buckets": sync.bucket_sizes, **ratio}
    results["ddp_buckets"] = ddp_bucket_timeline(args, x) if _engine.state()[0] else []
    dist.destroy_process_group()

    # --- overlap ------------------------------------------------------------------------
    a = torch.randn(256, 256)
    buf = torch.zeros(4 << 20)  # 16 MiB

    def compute(chunks=8, poke=None):
        for _ in range(chunks):
            for _ in range(6):
                a @ a
            if poke is not None:
                poke.test()

    def back_to_back():
        fastreduce.allreduce_(buf)
        compute()

    def overlapped(poke_progress):
        req = fastreduce.iallreduce_(buf)
        compute(poke=req if poke_progress else None)
        req.wait()

    def no_engine(poke_progress):
        _engine.set_host(False)
        try:
            overlapped(poke_progress)
        finally:
            _engine.set_host(None)

    over = {"compute": [], "allreduce": [], "back to back": [], "overlapped": [],
            "overlapped, no engine": [], "overlapped + test(), no engine": []}
    for _ in range(args.repeat):
        over["compute"].append(timed(comm, compute, 5))
        over["allreduce"].append(timed(comm, lambda: fastreduce.allreduce_(buf), 5))
        over["back to back"].append(timed(comm, back_to_back, 5))
        over["overlapped"].append(timed(comm, lambda: overlapped(False), 5))
        over["overlapped, no engine"].append(timed(comm, lambda: no_engine(False), 5))
        over["overlapped + test(), no engine"].append(timed(comm, lambda: no_engine(True), 5))
    results["overlap_ms"] = {k: statistics.median(v) * 1e3 for k, v in over.items()}
    results["overlap"] = {
        k: statistics.median(o / b for o, b in zip(over[k], over["back to back"], strict=True))
        for k in ("overlapped", "overlapped, no engine", "overlapped + test(), no engine")}

    if rank == 0:
        print(f"# fastreduce {fastreduce.__version__} gradient-sync benchmark: {p} ranks, "
              f"{results['mpi']}, torch {torch.__version__}, median of {args.repeat} runs")
        c = results["coalesced"]
        print(f"coalesced: 100 tensors, separate {c['separate']:.1f} us, coalesced "
              f"{c['coalesced']:.1f} us, speedup {c['speedup']:.1f}x (target >= 10x)")
        s = results["step"]
        print(f"step: MLP with {s['tensors']} tensors, {s['parameters']} parameters, batch "
              f"{s['batch']}; buckets {s['buckets']}")
        for k, v in results["step_ms"].items():
            print(f"  {k:32s} {v:9.2f} ms")
        print(f"  GradientSync / DDP gloo            {s['GradientSync / DDP gloo']:.2f} "
              f"(target <= 0.5)")
        print(f"  GradientSync / (no comm + C floor) "
              f"{s['GradientSync / (no comm + C floor)']:.2f} (target <= 1.1)")
        for key in s:
            if key.startswith("DDP fastreduce"):
                print(f"  {key:34s} {s[key]:.2f}")
        if results["ddp_buckets"]:
            print("DDP on fastreduce, bucket all-reduces (ms from the start of backward):")
            for b in results["ddp_buckets"]:
                print(f"  bucket {b['bucket']}: started {b['start_ms']:7.2f}, "
                      f"done {b['done_ms']:7.2f}")
        print("overlap: 16 MiB iallreduce_ with a matmul loop")
        for k, v in results["overlap_ms"].items():
            print(f"  {k:20s} {v:9.2f} ms")
        for k, v in results["overlap"].items():
            print(f"  {k} / back to back: {v:.2f} (target <= 1.05)")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
