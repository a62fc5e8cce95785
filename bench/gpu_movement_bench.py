"""Every collective on CUDA tensors: fastreduce's staged path against the same steps done
by hand, in one MPI job.

    mpiexec -n 2 python bench/gpu_movement_bench.py [--sizes 1M,4M,16M,64M] [--repeat 3]
                                                    [--staging-chunk 0]
    mpiexec -n 2 python bench/gpu_movement_bench.py --host-check   (no GPU: a check that
                                                                    it runs; times mean nothing)

Needs torch with CUDA and a GPU on every rank (ranks may share one: cuda:(local_rank %
device_count)). fastreduce is forced onto its staged path (set_cuda_aware(False)), so the
MPI need not be CUDA-aware. float32, sum, root rank 0; sizes in nccl-tests' convention, as
`fastreduce-bench -c` (the larger of a rank's send and receive buffers).

  A  fastreduce  fastreduce's call on the CUDA tensors (allreduce_, broadcast_, reduce_,
                 allgather, reduce_scatter, alltoall, gather, scatter; out= given), then
                 torch.cuda.synchronize()
  B  by hand     what a user writes without fastreduce (fastreduce-bench's mpi4py column
                 with --device cuda, tools/benchmark/collectives.py's staged_by_hand): the
                 bytes this rank sends copied to pinned host memory (host.copy_(dev), which
                 waits), the same MPI call from mpi4py on the pinned buffers, what it
                 received copied back (dev.copy_(host, non_blocking=True)), the stream
                 synchronised
  mpi            the MPI call alone on host buffers, in a C loop (bench/floor.c)

Each time is the average over ranks of the benchmark tool's timed loop (warm-up, barrier,
timed calls, device synchronised); each repeat times the three in an order that rotates;
the table gives medians over the repeats, of the times and of A/B taken within each. Per
collective and size, after timing: fastreduce's copies per call (its counters), the pinned
memory it grew by in a second call (0: reused), and its call checked once on
rank-dependent inputs (#wrong, bench/results JSON with --json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from mpi4py import MPI

NAMES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
         "gather", "scatter")  # the order of the tables in docs/benchmarks.md
OP = "sum"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M", help="nccl-tests' sizes")
    parser.add_argument("-c", "--collectives", default=",".join(NAMES),
                        help=f"comma-separated, of {', '.join(NAMES)}")
    parser.add_argument("--repeat", type=int, default=3, help="repeats; medians reported")
    parser.add_argument("--staging-chunk", default="0",
                        help="a fixed chunk for the staged pipeline (set_staging_chunk; 0: "
                             "fastreduce's plan; at least the message: staged whole)")
    parser.add_argument("--json", help="write every number to this file (rank 0)")
    parser.add_argument("--host-check", action="store_true",
                        help="without a GPU: CPU tensors and pageable host buffers, 2 timed "
                             "calls; checks that the script runs, its times mean nothing")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    import torch

    usable = torch.cuda.is_available()
    if not args.host_check and world.allreduce(int(usable), MPI.MIN) == 0:
        if world.rank == 0:
            print(f"gpu_movement_bench.py needs torch with CUDA and a GPU on every rank; "
                  f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}) on "
                  f"{platform.node()} or another rank has none (--host-check runs it on "
                  f"the CPU)", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.collectives.split(",") if n.strip()]
    if not names or set(names) - set(NAMES) or args.repeat < 1:
        raise SystemExit(f"-c takes some of {', '.join(NAMES)}; --repeat >= 1")

    import fastreduce
    import fastreduce.backend.cudart as frcuda
    from fastreduce._abi import first_line
    from fastreduce.sizes import format_size, parse_size
    from fastreduce.tools.benchmark import collectives, floor
    from fastreduce.tools.benchmark.timing import _time

    comm = fastreduce.default_comm()
    p, rank = comm.Get_size(), comm.Get_rank()
    if args.host_check:
        device, sync = torch.device("cpu"), (lambda: None)
    else:
        torch.cuda.set_device(fastreduce.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        sync = torch.cuda.synchronize
        fastreduce.set_cuda_aware(False)  # the staged path, whatever the MPI
        fastreduce.allreduce_(torch.zeros(1, device=device))  # loads the CUDA runtime
    timed_device = "cpu" if args.host_check else "cuda"
    chunk = parse_size(args.staging_chunk)
    frcuda.set_staging_chunk(chunk)
    lib = floor.load(MPI.COMM_WORLD)

    def measure(name: str, nbytes: int, count: int) -> dict:
        case = collectives.Case(name, "torch", "float32", count, comm, device)
        fr = collectives.fastreduce_call(case, OP, comm)
        iters = 2 if args.host_check else max(5, min(50, (256 << 20) // nbytes))
        warmup = 1 if args.host_check else 2
        by_hand = collectives.staged_by_hand(name, "float32", count, OP, comm, device)
        c_loop = collectives.c_timer(lib, collectives.numpy_case(name, "float32", count, comm),
                                     OP, comm)
        timers = {
            "A fastreduce": lambda: _time(comm, lambda: (fr(), sync()), iters, warmup,
                                          timed_device),
            "B by hand": lambda: _time(comm, by_hand, iters, warmup, timed_device),
            "mpi": lambda: c_loop(warmup, iters),
        }
        samples: dict[str, list[float]] = {k: [] for k in timers}
        order = list(timers)
        for r in range(args.repeat):
            for col in order[r % len(order):] + order[:r % len(order)]:
                comm.Barrier()
                samples[col].append(comm.allreduce(timers[col]()) / p)
        frcuda.reset_copy_counts()
        fr()
        sync()
        first = frcuda.copy_counts()
        fr()
        sync()
        second = frcuda.copy_counts()
        wrong = comm.allreduce(collectives.check(case, OP, comm))
        return {
            "collective": name, "bytes": nbytes, "count": count, "iters": iters,
            "samples": samples, "wrong": wrong,
            "ratio_a_b": statistics.median(a / b for a, b in zip(
                samples["A fastreduce"], samples["B by hand"], strict=True)),
            "copies_per_call": {k: comm.allreduce(first[k], MPI.MAX)
                                for k in ("d2h_copies", "h2d_copies")},
            "pinned_grew_bytes": comm.allreduce(second["pinned_bytes"] - first["pinned_bytes"],
                                                MPI.MAX),
        }

    rows = []
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for name in names:
        for nbytes, count in collectives.rows_for(name, sizes, 4, p):
            rows.append(measure(name, nbytes, count))
            if rank == 0:
                print(f"  measured {name} {format_size(nbytes, exact=False)}",
                      file=sys.stderr, flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "ranks": p, "mpi": " ".join(first_line(MPI.Get_library_version()).split()),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": "none (--host-check)" if args.host_check else torch.cuda.get_device_name(),
        "fastreduce": fastreduce.__version__, "dtype": "float32", "op": OP,
        "root": collectives.ROOT, "repeat": args.repeat,
        "staging_chunk": chunk or "fastreduce's plan",
    }
    if rank == 0:
        print_table(meta, rows, p)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 1 if sum(r["wrong"] for r in rows) else 0


def print_table(meta: dict, rows: list[dict], p: int) -> None:
    from fastreduce.sizes import format_size
    from fastreduce.tools.benchmark.collectives import bus_factor

    print(f"Measured {meta['date']} on {meta['machine']}, {meta['ranks']} ranks, "
          f"{meta['gpu']}; {meta['mpi']}; torch {meta['torch']} (CUDA {meta['cuda']}); "
          f"float32, sum, root 0, fastreduce's staged path (staging chunk: "
          f"{meta['staging_chunk']}). Time = average over ranks (us), "
          f"median of {meta['repeat']} repeats; A/B within each repeat, median.")
    print()
    print("| collective | size | A fastreduce (us) | B by hand (us) | A / B | mpi alone (us) "
          "| A busbw (GB/s) | copies d2h / h2d | pinned grew | #wrong |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["samples"]
        a, b, m = (statistics.median(s[k]) * 1e6 for k in ("A fastreduce", "B by hand", "mpi"))
        busbw = r["bytes"] / (a * 1e-6) / 1e9 * bus_factor(r["collective"], p)
        c = r["copies_per_call"]
        print(f"| {r['collective']} | {format_size(r['bytes'], exact=False)} | {a:.1f} | "
              f"{b:.1f} | {r['ratio_a_b']:.2f} | {m:.1f} | {busbw:.2f} | {c['d2h_copies']} / "
              f"{c['h2d_copies']} | {r['pinned_grew_bytes']} | {r['wrong']} |")
    worst = max(rows, key=lambda r: r["ratio_a_b"])
    print(f"\nA / B: worst {worst['ratio_a_b']:.2f} ({worst['collective']}); target <= 1.1 "
          f"from 1 MiB to 64 MiB")


if __name__ == "__main__":
    sys.exit(main())
