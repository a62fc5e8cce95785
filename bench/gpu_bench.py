"""All-reduce of CUDA tensors: fastreduce's staged path against the same steps done by hand.

    mpiexec -n 2 python bench/gpu_bench.py [--json PATH] [--repeat 5] [-b 1M] [-e 256M] [-f 2]

Needs torch with CUDA and a GPU on every rank; ranks may share one GPU (each rank uses
cuda:(local_rank % device_count)). The MPI need not be CUDA-aware: fastreduce is forced
onto its staged path (fastreduce.set_cuda_aware(False)): device -> pinned host on the
stream, MPI on the host, host -> device, large messages pipelined in chunks. float32 sum,
in place, on fastreduce's default communicator. Every column runs in the same job, size by
size, interleaved within each repetition; the table shows medians over --repeat
repetitions of the per-call latency (each repetition: a timed loop, averaged over ranks);
ratios are taken within each repetition, then the median.

Large messages (-b .. -e, default 1 MiB .. 256 MiB):
  A  fastreduce  fastreduce.allreduce_(dev); torch.cuda.synchronize()
  B  by hand     host.copy_(dev) (pinned host, synchronous); MPI_Allreduce in place on the
                 host from C (bench/floor.c); dev.copy_(host, non_blocking=True);
                 torch.cuda.synchronize()
  C  B's parts   d2h: host.copy_(dev); mpi: the C MPI_Allreduce loop alone;
                 h2d: dev.copy_(host, non_blocking=True) + synchronize
  A/B is the number to watch (target <= 1.2x from 1 MiB to 256 MiB; below 1 means the
  pipeline hides copies behind MPI). `chunks` is fastreduce.backend.cudart.plan_staging's split.

Small messages (4 B .. 1 KiB), to attribute what CUDA adds over the CPU path:
  cpu          fastreduce.allreduce_ on a CPU tensor
  cuda         fastreduce.allreduce_ on a CUDA tensor, then stream.synchronize()
  cuda nosync  the same without the synchronize (one after the loop): the host-side cost
  sync         stream.synchronize() on an idle stream
  d2h, h2d     a copy of the message to / from pinned host memory + stream.synchronize()
  C floor      the C MPI_Allreduce loop on host memory
  model = cpu + d2h + h2d (the staged path's two copies, each waited for once);
  residual = cuda - model.

After timing, A and B are each checked once on rank-dependent data (#wrong). The JSON
(--json, default bench/results/gpu-<mpi>-np<ranks>.json) holds every number.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from mpi4py import MPI

HERE = Path(__file__).resolve().parent


def sizes(begin: int, end: int, factor: int) -> list[int]:
    out, n = [], max(begin, 4)
    while n <= end:
        out.append(n)
        n *= factor
    return out


def timed(comm, fn, warmup: int, iters: int, finish=None) -> float:
    """Seconds per call of fn() over `iters` calls, after `warmup` untimed ones and a
    barrier; finish() (e.g. a synchronize) ends both loops and is inside the timing."""
    for _ in range(warmup):
        fn()
    if finish is not None:
        finish()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if finish is not None:
        finish()
    return (time.perf_counter() - start) / iters


def across_ranks(comm, seconds: float) -> tuple[float, float, float]:
    """(average, min, max) over ranks."""
    return (comm.allreduce(seconds, MPI.SUM) / comm.size, comm.allreduce(seconds, MPI.MIN),
            comm.allreduce(seconds, MPI.MAX))


class Buffers:
    """One message size: a CUDA tensor, a pinned host tensor and (small sizes) a plain CPU
    tensor; zeros, so repeated in-place sums stay finite."""

    def __init__(self, torch, nbytes: int, device, with_cpu: bool = False):
        self.count = nbytes // 4
        self.dev = torch.zeros(self.count, dtype=torch.float32, device=device)
        self.host = torch.zeros(self.count, dtype=torch.float32, pin_memory=True)
        self.cpu = torch.zeros(self.count, dtype=torch.float32) if with_cpu else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-b", "--begin", default="1M", help="smallest large message")
    parser.add_argument("-e", "--end", default="256M", help="largest large message")
    parser.add_argument("-f", "--factor", type=int, default=2, help="size step (2 or 4)")
    parser.add_argument("--small", default="4,16,64,256,1024",
                        help="small message sizes in bytes (empty: skip)")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions; medians reported")
    parser.add_argument("--iters-small", type=int, default=1000)
    parser.add_argument("--json", help="write every number here (rank 0; default "
                                       "bench/results/gpu-<mpi>-np<ranks>.json)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    try:
        import torch
        usable = torch.cuda.is_available()
        cuda = torch.version.cuda or "none: a CPU build"
        why = "" if usable else (f"torch {torch.__version__} (CUDA {cuda}) says "
                                 f"torch.cuda.is_available() is False")
    except ImportError:
        usable, why = False, "torch is not installed"
    if world.allreduce(int(usable), MPI.MIN) == 0:
        if world.rank == 0:
            print(f"gpu_bench.py needs torch with CUDA and a GPU on every rank; on "
                  f"{platform.node()}: {why or 'another rank has no GPU'}", file=sys.stderr)
        return 2
    if args.repeat < 1 or args.factor < 2:
        raise SystemExit("--repeat must be >= 1 and --factor >= 2")

    import fastreduce
    import fastreduce.backend.cudart as frcuda
    from fastreduce._abi import first_line
    from fastreduce.sizes import format_size, parse_size

    sys.path.insert(0, str(HERE))
    from allreduce_bench import load_floor  # noqa: E402  (bench/ is not a package)

    torch.cuda.set_device(fastreduce.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    fastreduce.set_cuda_aware(False)  # the staged path, whatever the MPI
    comm = fastreduce.default_comm()
    p, rank = comm.size, comm.rank
    fcomm = comm.py2f()
    floor = load_floor(comm)
    floor.floor_allreduce_once.restype = ctypes.c_int
    floor.floor_allreduce_once.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int]
    stream = torch.cuda.current_stream()
    fastreduce.allreduce_(torch.zeros(1, device=device))  # loads the CUDA runtime

    def c_loop(buf: Buffers, warmup: int, iters: int) -> float:
        t = floor.floor_allreduce(fcomm, None, buf.host.data_ptr(), buf.count, warmup, iters)
        if t < 0:
            raise MPI.Exception(int(-t))
        return t

    def by_hand(buf: Buffers) -> None:
        buf.host.copy_(buf.dev)  # pinned destination, non_blocking=False: waits for it
        err = floor.floor_allreduce_once(fcomm, None, buf.host.data_ptr(), buf.count)
        if err:
            raise MPI.Exception(err)
        buf.dev.copy_(buf.host, non_blocking=True)
        torch.cuda.synchronize()

    def fastreduce_staged(buf: Buffers) -> None:
        fastreduce.allreduce_(buf.dev)
        torch.cuda.synchronize()

    def wrong(buf: Buffers, fn) -> int:
        """Elements not equal to p(p+1)/2 after fn reduces rank + 1 (then zeroed again)."""
        buf.dev.fill_(rank + 1)
        fn(buf)
        bad = int((buf.dev != p * (p + 1) / 2).sum())
        buf.dev.zero_()
        torch.cuda.synchronize()
        return comm.allreduce(bad)

    def large_runs(buf: Buffers, iters: int, warmup: int = 2) -> dict:
        return {
            "A fastreduce": lambda: timed(comm, lambda: fastreduce_staged(buf), warmup, iters),
            "B by hand": lambda: timed(comm, lambda: by_hand(buf), warmup, iters),
            "d2h": lambda: timed(comm, lambda: buf.host.copy_(buf.dev), warmup, iters),
            "mpi": lambda: c_loop(buf, warmup, iters),
            "h2d": lambda: timed(comm, lambda: buf.dev.copy_(buf.host, non_blocking=True),
                                 warmup, iters, torch.cuda.synchronize),
        }

    def small_runs(buf: Buffers, iters: int, warmup: int) -> dict:
        def sync_after(fn):
            return lambda: (fn(), stream.synchronize())

        return {
            "cpu": lambda: timed(comm, lambda: fastreduce.allreduce_(buf.cpu), warmup, iters),
            "cuda": lambda: timed(comm, sync_after(lambda: fastreduce.allreduce_(buf.dev)),
                                  warmup, iters),
            "cuda nosync": lambda: timed(comm, lambda: fastreduce.allreduce_(buf.dev), warmup,
                                         iters, stream.synchronize),
            "sync": lambda: timed(comm, stream.synchronize, warmup, iters),
            "d2h": lambda: timed(comm, sync_after(
                lambda: buf.host.copy_(buf.dev, non_blocking=True)), warmup, iters),
            "h2d": lambda: timed(comm, sync_after(
                lambda: buf.dev.copy_(buf.host, non_blocking=True)), warmup, iters),
            "C floor": lambda: c_loop(buf, warmup, iters),
        }

    props = torch.cuda.get_device_properties(device)
    my_gpu = (MPI.Get_processor_name(), str(getattr(props, "uuid", device.index)))
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": p,
        "nodes": len(set(comm.allgather(MPI.Get_processor_name()))),
        "ranks_per_gpu": comm.allgather(my_gpu).count(my_gpu),  # rank 0's GPU
        "gpu": torch.cuda.get_device_name(device),
        "mpi": first_line(MPI.Get_library_version()),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudart": frcuda.runtime_info(),
        "fastreduce": fastreduce.__version__,
        "cuda_aware": list(fastreduce.cuda_aware()),
        "dtype": "float32", "op": "sum", "repeat": args.repeat,
    }

    large_rows = []
    large = sizes(parse_size(args.begin), parse_size(args.end), args.factor)
    large_cols = ("A fastreduce", "B by hand", "d2h", "mpi", "h2d")
    for nbytes in large:
        buf = Buffers(torch, nbytes, device)
        runs = large_runs(buf, iters=max(3, min(50, (200 << 20) // nbytes)))
        samples = {name: [] for name in large_cols}
        for _ in range(args.repeat):
            for name in large_cols:
                comm.Barrier()
                samples[name].append(across_ranks(comm, runs[name]()))
        frcuda.reset_copy_counts()
        fastreduce.allreduce_(buf.dev)
        torch.cuda.synchronize()
        counts = frcuda.copy_counts()
        chunk, nchunks = frcuda.plan_staging(nbytes)
        row = summarise(nbytes, samples, {"A fastreduce": wrong(buf, fastreduce_staged),
                                          "B by hand": wrong(buf, by_hand)})
        row["staging"] = {"chunk_bytes": chunk, "chunks": nchunks,
                          "d2h_copies_per_call": counts["d2h_copies"],
                          "pinned_bytes": counts["pinned_bytes"]}
        large_rows.append(row)
        if rank == 0:
            print(f"  measured {format_size(nbytes, exact=False)}", file=sys.stderr, flush=True)
        del buf

    small_rows = []
    small = [int(s) for s in args.small.split(",") if s.strip()]
    small_cols = ("cpu", "cuda", "cuda nosync", "sync", "d2h", "h2d", "C floor")
    for nbytes in small:
        buf = Buffers(torch, nbytes, device, with_cpu=True)
        runs = small_runs(buf, args.iters_small, max(10, args.iters_small // 10))
        samples = {name: [] for name in small_cols}
        for _ in range(args.repeat):
            for name in small_cols:
                comm.Barrier()
                samples[name].append(across_ranks(comm, runs[name]()))
        row = {"bytes": nbytes, "lat_us": {}, "wrong": wrong(buf, fastreduce_staged)}
        for name, values in samples.items():
            row["lat_us"][name] = {k: statistics.median(v[i] for v in values) * 1e6
                                   for i, k in enumerate(("avg", "min", "max"))}
        lat = {name: row["lat_us"][name]["avg"] for name in small_cols}
        row["model_us"] = lat["cpu"] + lat["d2h"] + lat["h2d"]
        row["residual_us"] = lat["cuda"] - row["model_us"]
        row["ratio_cuda_cpu"] = statistics.median(
            a[0] / b[0] for a, b in zip(samples["cuda"], samples["cpu"], strict=True))
        small_rows.append(row)
        del buf

    if rank == 0:
        print_tables(meta, large_rows, small_rows)
        path = Path(args.json) if args.json else (
            HERE / "results" / f"gpu-{fastreduce.build_mpi()[0].replace(' ', '').lower()}"
                               f"-np{p}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "large": large_rows, "small": small_rows},
                                   indent=1))
        print(f"# written to {path}")
    total = sum(sum(r["wrong"].values()) for r in large_rows) + sum(r["wrong"]
                                                                   for r in small_rows)
    return 1 if total else 0


def summarise(nbytes: int, samples: dict, wrong: dict) -> dict:
    """Medians over the repetitions of latency, and of the ratios taken within each."""
    def med(name, i=0):
        return statistics.median(s[i] for s in samples[name])

    row = {"bytes": nbytes, "lat_us": {}, "ratio": {}, "wrong": wrong}
    for name in samples:
        row["lat_us"][name] = {k: med(name, i) * 1e6 for i, k in enumerate(("avg", "min", "max"))}
    a, b = samples["A fastreduce"], samples["B by hand"]
    parts = [d[0] + m[0] + h[0] for d, m, h in zip(samples["d2h"], samples["mpi"],
                                                   samples["h2d"], strict=True)]
    row["ratio"]["A/B"] = statistics.median(x[0] / y[0] for x, y in zip(a, b, strict=True))
    row["ratio"]["A/parts"] = statistics.median(x[0] / y for x, y in zip(a, parts, strict=True))
    row["ratio"]["B/parts"] = statistics.median(x[0] / y for x, y in zip(b, parts, strict=True))
    row["algbw_GBps"] = {name: nbytes / (row["lat_us"][name]["avg"] * 1e-6) / 1e9
                         for name in samples}
    return row


def print_tables(meta: dict, large: list[dict], small: list[dict]) -> None:
    from fastreduce.sizes import format_size

    print(f"# fastreduce {meta['fastreduce']} GPU all-reduce benchmark, {meta['date']}")
    print(f"# {meta['ranks']} ranks on {meta['nodes']} node(s), {meta['ranks_per_gpu']} per "
          f"GPU ({meta['gpu']}); {meta['machine']}; {meta['mpi']}; torch {meta['torch']} CUDA "
          f"{meta['cuda']}; cuda_aware {meta['cuda_aware'][0]} (staged path)")
    print(f"# float32 sum in place; latency us = average over ranks, median of "
          f"{meta['repeat']} repetitions; ratios within each repetition, median")
    if large:
        print(f"{'size':>8} {'chunks':>6} {'A fastreduce':>12} {'B by hand':>10} {'A/B':>6} "
              f"{'d2h':>9} {'mpi':>9} {'h2d':>9} {'A/parts':>7} {'A GB/s':>7} {'#wrong':>6}")
        for row in large:
            lat = {k: v["avg"] for k, v in row["lat_us"].items()}
            print(f"{format_size(row['bytes'], exact=False):>8} {row['staging']['chunks']:6d} "
                  f"{lat['A fastreduce']:12.1f} {lat['B by hand']:10.1f} "
                  f"{row['ratio']['A/B']:5.2f}x {lat['d2h']:9.1f} {lat['mpi']:9.1f} "
                  f"{lat['h2d']:9.1f} {row['ratio']['A/parts']:6.2f}x "
                  f"{row['algbw_GBps']['A fastreduce']:7.2f} {sum(row['wrong'].values()):6d}")
        worst = max(row["ratio"]["A/B"] for row in large)
        print(f"# A/B: worst {worst:.2f}x over {format_size(large[0]['bytes'], exact=False)}.."
              f"{format_size(large[-1]['bytes'], exact=False)} (target <= 1.2x)")
    if small:
        print(f"{'size':>8} {'cpu':>8} {'cuda':>8} {'cuda/cpu':>8} {'nosync':>8} {'sync':>7} "
              f"{'d2h':>7} {'h2d':>7} {'C floor':>8} {'model':>8} {'residual':>8} {'#wrong':>6}")
        for row in small:
            lat = {k: v["avg"] for k, v in row["lat_us"].items()}
            print(f"{format_size(row['bytes'], exact=False):>8} {lat['cpu']:8.2f} "
                  f"{lat['cuda']:8.2f} "
                  f"{row['ratio_cuda_cpu']:7.1f}x {lat['cuda nosync']:8.2f} {lat['sync']:7.2f} "
                  f"{lat['d2h']:7.2f} {lat['h2d']:7.2f} {lat['C floor']:8.2f} "
                  f"{row['model_us']:8.2f} {row['residual_us']:8.2f} {row['wrong']:6d}")
        print("# small: model = cpu + d2h + h2d (each copy + one synchronize); residual = cuda "
              "- model")
    total = sum(sum(r["wrong"].values()) for r in large) + sum(r["wrong"] for r in small)
    print(f"# correctness check after timing: {total} wrong elements")


if __name__ == "__main__":
    sys.exit(main())
