"""torch.distributed's collectives on a fastreduce group against the same MPI call from
mpi4py, fastreduce's own compiled call and the C loop, in one MPI job.

    mpiexec -n 2 python bench/collectives_bench.py [--repeat 5] [--json FILE]
    mpiexec -n 2 python bench/collectives_bench.py --quick      (few iterations: a check)

float32. The size is the per-rank message: NCCL's count argument times 4 bytes, i.e.

  all_gather_into_tensor  each rank's input (the output is p x size)
  reduce_scatter_tensor   each rank's output (the input is p x size), sum
  broadcast               the tensor (root: rank 0)
  all_to_all_single       what each rank sends to each rank (input and output: p x size)
  all_reduce              the tensor, sum, in place

(fastreduce-bench -c uses nccl-tests' size instead, the larger of a rank's buffers.)

Columns, all four on the same memory (the torch tensors are views of the numpy arrays):

  torch.distributed  dist.all_gather_into_tensor(out, x) / reduce_scatter_tensor(out, x) /
                     broadcast(x, 0) / all_to_all_single(out, x) / all_reduce(x) on the
                     default group, dist.init_process_group("fastreduce")
  mpi4py             comm.Allgather(x, out) / Reduce_scatter_block(x, out, MPI.SUM) /
                     Bcast(x, 0) / Alltoall(x, out) / Allreduce(MPI.IN_PLACE, x) on numpy
  fastreduce         fastreduce.allgather(x, out=out) / reduce_scatter(x, out=out) /
                     broadcast_(x, 0) / alltoall(x, out=out) / allreduce_(x) on the tensors
  C                  the same MPI call in a C loop (bench/floor.c, built with mpicc)

Each time is the average over ranks of fastreduce-bench's timed loop (warm-up, barrier,
timed iterations); each repeat times every column once, in an order that rotates from
repeat to repeat so that drift hits all alike; the table gives medians over the repeats,
of the times and of the ratios taken within each repeat. A second table: the same calls
from 4 B to 4 KiB, fastreduce's call against the C loop, as the difference in
microseconds. After timing, fastreduce's call is checked once at every size (#wrong).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import mpi4py
import torch
import torch.distributed as dist
from mpi4py import MPI

import fastreduce
import fastreduce.distributed  # noqa: F401  (registers the torch.distributed backend)
from fastreduce import topology
from fastreduce._abi import first_line
from fastreduce.sizes import format_size, parse_size
from fastreduce.tools.benchmark import collectives, floor
from fastreduce.tools.benchmark.timing import _iterations, _time

# (torch.distributed's name, fastreduce-bench's collective, fastreduce's call)
CALLS = (("all_gather_into_tensor", "allgather", "allgather"),
         ("reduce_scatter_tensor", "reduce_scatter", "reduce_scatter"),
         ("broadcast", "broadcast", "broadcast_"),
         ("all_to_all_single", "alltoall", "alltoall"),
         ("all_reduce", "allreduce", "allreduce_"))
COLUMNS = ("torch.distributed", "mpi4py", "fastreduce", "C")
OP = "sum"


def cases(name: str, nbytes: int, comm) -> tuple:
    """The numpy buffers of one collective and size, and torch tensors on their memory."""
    numpy_case = collectives.Case(name, "numpy", "float32", nbytes // 4, comm)
    torch_case = copy.copy(numpy_case)
    torch_case.kind = "torch"
    torch_case.x = None if numpy_case.x is None else torch.from_numpy(numpy_case.x)
    torch_case.out = None if numpy_case.out is None else torch.from_numpy(numpy_case.out)
    return numpy_case, torch_case


def columns(name: str, nbytes: int, comm, lib, only=COLUMNS) -> tuple[dict, object]:
    """column -> (warmup, iters) -> seconds per call on this rank; and the torch case."""
    numpy_case, torch_case = cases(name, nbytes, comm)
    out = {
        "torch.distributed": (collectives.torch_call(torch_case, OP, None), None),
        "mpi4py": (collectives.mpi4py_call(numpy_case, OP, comm), None),
        "fastreduce": (collectives.fastreduce_call(torch_case, OP, comm), None),
        "C": (None, collectives.c_timer(lib, numpy_case, OP, comm)),
    }

    def timer(fn, c_loop):
        if c_loop is not None:
            return c_loop
        return lambda warmup, iters: _time(comm, fn, iters, warmup)

    return {col: timer(*out[col]) for col in only}, torch_case


def measure(name: str, nbytes: int, comm, lib, repeat: int, iters: int, warmup: int,
            only=COLUMNS) -> dict:
    """Every column `repeat` times (the order rotating); per column the list of times (s),
    each the average over ranks; and #wrong of fastreduce's call, checked after timing."""
    timers, torch_case = columns(name, nbytes, comm, lib, only)
    p = comm.Get_size()
    samples: dict[str, list[float]] = {col: [] for col in timers}
    order = list(timers)
    for r in range(repeat):
        for col in order[r % len(order):] + order[:r % len(order)]:
            comm.Barrier()
            samples[col].append(comm.allreduce(timers[col](warmup, iters)) / p)
    wrong = comm.allreduce(collectives.check(torch_case, OP, comm))
    return {"samples": samples, "wrong": wrong}


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,1M,16M",
                        help="per-rank message sizes of the first table (float32)")
    parser.add_argument("--small", default="4,16,64,256,1K,4K",
                        help="sizes of the second table (fastreduce against C)")
    parser.add_argument("--repeat", type=int, default=5, help="repeats; medians reported")
    parser.add_argument("-n", "--iters", type=int, default=0,
                        help="timed iterations (default as fastreduce-bench: 1000 up to "
                        "64 KiB, fewer above)")
    parser.add_argument("--quick", action="store_true",
                        help="20 iterations (2 warm-up), 2 repeats: checks that it runs")
    parser.add_argument("--json", help="write every number to this file (rank 0)")
    args = parser.parse_args()
    if args.quick:
        args.iters, args.repeat = args.iters or 20, min(args.repeat, 2)
    timing = SimpleNamespace(iters=args.iters, warmup=2 if args.quick else 0)
    torch.set_num_threads(1)

    comm = fastreduce.default_comm()
    rank, p = comm.Get_rank(), comm.Get_size()
    dist.init_process_group("fastreduce")
    try:
        lib = floor.load(MPI.COMM_WORLD)
    except floor.FloorUnavailable as exc:
        if rank == 0:
            print(f"collectives_bench: the C loop cannot be built: {exc}", file=sys.stderr)
        return 2
    nodes = topology.gather()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "topology": nodes.summary(), "ranks": p,
        "mpi": " ".join(first_line(MPI.Get_library_version()).split()),
        "torch": torch.__version__, "mpi4py": mpi4py.__version__,
        "fastreduce": fastreduce.__version__, "dtype": "float32", "op": OP,
        "repeat": args.repeat, "iters": args.iters or "default",
    }

    rows, small = [], []
    for torch_name, name, _fr in CALLS:
        for nbytes in (parse_size(s) for s in args.sizes.split(",")):
            iters, warmup = _iterations(timing, nbytes)
            result = measure(name, nbytes, comm, lib, args.repeat, iters, warmup)
            rows.append({"call": torch_name, "bytes": nbytes, "iters": iters, **result})
            if rank == 0:
                print(f"  measured {torch_name} {format_size(nbytes, exact=False)}",
                      file=sys.stderr, flush=True)
    for _torch_name, name, fr in CALLS:
        for nbytes in (parse_size(s) for s in args.small.split(",")):
            iters, warmup = _iterations(timing, nbytes)
            result = measure(name, nbytes, comm, lib, args.repeat, iters, warmup,
                             only=("fastreduce", "C"))
            small.append({"call": fr, "bytes": nbytes, "iters": iters, **result})
    if rank == 0:
        print_tables(meta, rows, small)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows,
                                                   "small": small}, indent=1))
    wrong = sum(r["wrong"] for r in rows + small)
    dist.destroy_process_group()
    return 1 if wrong else 0


def print_tables(meta: dict, rows: list[dict], small: list[dict]) -> None:
    us = 1e6
    print(f"Measured {meta['date']} on {meta['machine']}: {meta['topology']}; "
          f"{meta['mpi']}; torch {meta['torch']}, mpi4py {meta['mpi4py']}, fastreduce "
          f"{meta['fastreduce']}. float32; size = the per-rank message (NCCL's count x 4 B: "
          f"all_gather's input, reduce_scatter's output, what all_to_all sends to each rank, "
          f"broadcast's and all_reduce's tensor); time = average over ranks (us), median of "
          f"{meta['repeat']} repeats; ratios taken within each repeat, median.")
    print()
    print("| call | size | torch.distributed (us) | mpi4py (us) | fastreduce (us) | C (us) "
          "| torch.distributed / mpi4py | fastreduce / C |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["samples"]
        med = {col: statistics.median(s[col]) * us for col in COLUMNS}
        print(f"| `{r['call']}` | {format_size(r['bytes'], exact=False)} | "
              + " | ".join(f"{med[col]:.2f}" for col in COLUMNS)
              + f" | {median_ratio(s['torch.distributed'], s['mpi4py']):.2f} "
              f"| {median_ratio(s['fastreduce'], s['C']):.2f} |")
    print()
    print("| fastreduce call | size | fastreduce (us) | C (us) | fastreduce - C (us) |")
    print("|---|---:|---:|---:|---:|")
    for r in small:
        s = r["samples"]
        diff = statistics.median(a - b for a, b in zip(s["fastreduce"], s["C"], strict=True))
        print(f"| `{r['call']}` | {format_size(r['bytes'], exact=False)} | "
              f"{statistics.median(s['fastreduce']) * us:.2f} | "
              f"{statistics.median(s['C']) * us:.2f} | {diff * us:+.2f} |")
    print()
    wrong = sum(r["wrong"] for r in rows + small)
    print(f"Correctness check of fastreduce's call after timing: {wrong} wrong elements.")


if __name__ == "__main__":
    sys.exit(main())
