"""osu_allreduce-style comparison of fastreduce with C MPI_Allreduce and mpi4py.

    mpiexec -n 4 python bench/allreduce_bench.py [--repeat 5] [--json FILE]

Every column is measured in the same MPI job, on the same communicator (the
fastreduce default, a duplicate of COMM_WORLD), size by size and interleaved,
so the ratios compare like with like on a noisy machine. float32 sum.

  C floor        MPI_Allreduce(MPI_IN_PLACE, ...) in a C loop (bench/floor.c, same mpicc)
  C out of place MPI_Allreduce(send, recv, ...) in a C loop
  mpi4py+numpy   comm.Allreduce(MPI.IN_PLACE, ndarray)
  mpi4py+torch   comm.Allreduce(MPI.IN_PLACE, tensor)
  fr_ torch      fastreduce.allreduce_(tensor)
  fr torch       fastreduce.allreduce(tensor)       (new result tensor per call)
  gloo           torch.distributed.all_reduce(tensor) on a gloo group   (--gloo)

In-place columns are compared with the C floor; the out-of-place fastreduce
column with C out of place + torch.empty_like (its only extra work is
allocating the result). algbw = bytes / time, busbw = algbw * 2(p-1)/p.
After timing, each column is checked once on rank-dependent data (#wrong).
--columns measures a subset; --max-seconds bounds each measurement (slow links).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import fastreduce
from fastreduce._abi import first_line
from fastreduce.sizes import format_size, parse_size

HERE = Path(__file__).resolve().parent


def sizes(begin: int, end: int) -> list[int]:
    out, n = [], max(begin, 4)
    while n <= end:
        out.append(n)
        n *= 2
    return out


def iterations(nbytes: int, small: int, large: int) -> int:
    if nbytes <= 64 << 10:
        return small
    if nbytes <= 1 << 20:
        return large
    return max(10, large * (1 << 20) // nbytes)  # keep 64 MiB sweeps to seconds


def load_floor(comm: MPI.Comm):
    """Compile bench/floor.c with the mpicc fastreduce was built with (rank 0), load it."""
    target = HERE / "build" / f"floor-{fastreduce.build_mpi()[0].replace(' ', '')}.so"
    error = None
    if comm.rank == 0:
        target.parent.mkdir(exist_ok=True)
        mpicc = os.environ.get("MPICC") or str(Path(sys.executable).parent / "mpicc")
        if not Path(mpicc).exists():
            mpicc = "mpicc"
        cmd = [mpicc, "-O2", "-shared", "-fPIC", str(HERE / "floor.c"), "-o", str(target)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            error = f"{' '.join(cmd)} failed:\n{proc.stderr}"
    error = comm.bcast(error)
    if error:
        raise SystemExit(error)
    lib = ctypes.CDLL(str(target))
    lib.floor_allreduce.restype = ctypes.c_double
    lib.floor_allreduce.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


class Case:
    """The buffers of one message size, shared by every column."""

    def __init__(self, nbytes: int):
        self.count = nbytes // 4
        self.array = np.zeros(self.count, np.float32)
        self.other = np.zeros(self.count, np.float32)
        # the same memory as `array`: every in-place column reduces the same pages
        self.tensor = torch.from_numpy(self.array)


def timed_loop(comm, fn, arg, warmup: int, iters: int) -> float:
    for _ in itertools.repeat(None, warmup):
        fn(arg)
    comm.Barrier()
    start = time.perf_counter()
    for _ in itertools.repeat(None, iters):
        fn(arg)
    return (time.perf_counter() - start) / iters


def columns(comm, floor, gloo=None):
    """name -> (time(case, warmup, iters) -> seconds, check(case) -> #wrong elements)."""
    fcomm = comm.py2f()

    def floor_time(inplace):
        def run(case, warmup, iters):
            send = None if inplace else case.other.ctypes.data
            t = floor.floor_allreduce(fcomm, send, case.array.ctypes.data, case.count,
                                      warmup, iters)
            if t < 0:
                raise MPI.Exception(int(-t))
            return t
        return run

    def floor_check(inplace):
        def check(case):
            value = np.float32(comm.rank + 1)
            case.array[:] = value
            case.other[:] = value
            floor.floor_allreduce(fcomm, None if inplace else case.other.ctypes.data,
                                  case.array.ctypes.data, case.count, 0, 1)
            return expected_wrong(comm, case.array)
        return check

    def mpi4py_time(attr):
        def run(case, warmup, iters):
            return timed_loop(comm, lambda b: comm.Allreduce(MPI.IN_PLACE, b),
                              getattr(case, attr), warmup, iters)
        return run

    def mpi4py_check(attr):
        def check(case):
            buf = getattr(case, attr)
            buf[:] = comm.rank + 1
            comm.Allreduce(MPI.IN_PLACE, buf)
            return expected_wrong(comm, np.asarray(buf))
        return check

    def fr_inplace(case, warmup, iters):
        return timed_loop(comm, fastreduce.allreduce_, case.tensor, warmup, iters)

    def fr_inplace_check(case):
        case.tensor.fill_(comm.rank + 1)
        return expected_wrong(comm, fastreduce.allreduce_(case.tensor).numpy())

    def fr_new(case, warmup, iters):
        return timed_loop(comm, fastreduce.allreduce, case.tensor, warmup, iters)

    def fr_new_check(case):
        case.tensor.fill_(comm.rank + 1)
        return expected_wrong(comm, fastreduce.allreduce(case.tensor).numpy())

    def empty_like(case, warmup, iters):
        return timed_loop(comm, torch.empty_like, case.tensor, warmup, iters)

    def gloo_time(case, warmup, iters):
        return timed_loop(comm, gloo.all_reduce, case.tensor, warmup, iters)

    def gloo_check(case):
        case.tensor.fill_(comm.rank + 1)
        gloo.all_reduce(case.tensor)
        return expected_wrong(comm, case.array)

    cols = {
        "C floor": (floor_time(True), floor_check(True)),
        "C out of place": (floor_time(False), floor_check(False)),
        "mpi4py+numpy": (mpi4py_time("array"), mpi4py_check("array")),
        "mpi4py+torch": (mpi4py_time("tensor"), mpi4py_check("tensor")),
        "fr_ torch": (fr_inplace, fr_inplace_check),
        "fr torch": (fr_new, fr_new_check),
        "torch.empty_like": (empty_like, None),
    }
    if gloo is not None:
        cols["gloo"] = (gloo_time, gloo_check)
    return cols


WRONG_INJECTION = {"on": False}


def expected_wrong(comm, result: np.ndarray) -> int:
    """Elements of a sum of (rank + 1) over ranks that are not p(p+1)/2, on this rank."""
    want = comm.size * (comm.size + 1) / 2
    if WRONG_INJECTION["on"] and comm.rank == 0 and result.size:
        result = result.copy()
        result[0] += 1
    return int(np.count_nonzero(result != want))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-b", "--begin", default="4", help="smallest message (4, 1K, 1M)")
    parser.add_argument("-e", "--end", default="64M", help="largest message")
    parser.add_argument("--repeat", type=int, default=5, help="runs per size; medians reported")
    parser.add_argument("--iters-small", type=int, default=1000)
    parser.add_argument("--iters-large", type=int, default=100)
    parser.add_argument("--json", help="write every number to this file (rank 0)")
    parser.add_argument("--only", help="comma-separated columns to run (for investigations)")
    parser.add_argument("--columns", help="comma-separated columns for the table (default all)")
    parser.add_argument("--gloo", action="store_true",
                        help="add torch.distributed all_reduce on gloo as a column")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="fewer iterations where one measurement would take longer")
    parser.add_argument("--inject-wrong", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    WRONG_INJECTION["on"] = args.inject_wrong

    comm = fastreduce.default_comm()
    p, rank = comm.size, comm.rank
    floor = load_floor(comm)
    gloo = None
    if args.gloo:
        import torch.distributed as dist

        from fastreduce.tools.benchmark.peers import init_gloo

        init_gloo(comm)
        gloo = dist
    cols = columns(comm, floor, gloo)
    chosen = args.only or args.columns
    if chosen:
        cols = {name: cols[name] for name in chosen.split(",")}
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": p,
        "nodes": len(set(comm.allgather(MPI.Get_processor_name()))),
        "mpi": first_line(MPI.Get_library_version()),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastreduce": fastreduce.__version__,
        "dtype": "float32", "op": "sum", "repeat": args.repeat,
        "columns": list(cols), "max_seconds": args.max_seconds,
    }
    rows = []
    for nbytes in sizes(parse_size(args.begin), parse_size(args.end)):
        case = Case(nbytes)
        iters = iterations(nbytes, args.iters_small, args.iters_large)
        counts = {name: (iters, max(2, iters // 10)) for name in cols}
        for name, (run, _check) in cols.items() if args.max_seconds else ():
            one = comm.allreduce(run(case, 0, 1), MPI.MAX)
            if one * sum(counts[name]) > args.max_seconds:
                counts[name] = (max(1, int(args.max_seconds / one) - 1), 1)
        samples = {name: [] for name in cols}
        for _ in range(args.repeat):
            for name, (run, _check) in cols.items():
                comm.Barrier()
                mine = run(case, counts[name][1], counts[name][0])
                samples[name].append((comm.allreduce(mine, MPI.SUM) / p,
                                      comm.allreduce(mine, MPI.MIN),
                                      comm.allreduce(mine, MPI.MAX)))
        wrong = {name: comm.allreduce(check(case)) for name, (_r, check) in cols.items()
                 if check is not None}
        if args.only:
            if rank == 0:
                print(format_size(nbytes, exact=False),
                      {k: round(statistics.median(s[0] for s in v) * 1e6, 2)
                       for k, v in samples.items()}, wrong)
            continue
        rows.append(summarise(nbytes, samples, wrong, p))
        rows[-1]["iters"] = {name: n for name, (n, _w) in counts.items()}
        if rank == 0:
            print(f"  measured {nbytes} B", file=sys.stderr, flush=True)
    if rank == 0 and rows:
        print_table(meta, rows)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    total_wrong = sum(sum(row["wrong"].values()) for row in rows)
    return 1 if total_wrong else 0


def summarise(nbytes: int, samples: dict, wrong: dict, p: int) -> dict:
    """Medians over the runs of latency and of ratios taken within each run."""
    def med(name, i=0):
        return statistics.median(s[i] for s in samples[name])

    def ratio(name, base):
        return statistics.median(a[0] / b[0] for a, b in zip(samples[name], base, strict=True))

    bus = (2 * (p - 1) / p) if p > 1 else 0.0
    row = {"bytes": nbytes, "lat_us": {}, "ratio": {}, "busbw_GBps": {}, "wrong": wrong}
    for name in samples:
        row["lat_us"][name] = {k: med(name, i) * 1e6 for i, k in enumerate(("avg", "min", "max"))}
        row["busbw_GBps"][name] = nbytes / med(name) * bus / 1e9
    if "C floor" in samples:
        for name in ("mpi4py+numpy", "mpi4py+torch", "fr_ torch", "gloo"):
            if name in samples:
                row["ratio"][name] = ratio(name, samples["C floor"])
        if "fr_ torch" in samples:
            row["ratio"]["busbw fr_ / C floor"] = 1 / row["ratio"]["fr_ torch"]
    if set(OOP) <= set(samples):
        oop_base = [(c[0] + e[0],) for c, e in zip(samples["C out of place"],
                                                   samples["torch.empty_like"], strict=True)]
        row["ratio"]["fr torch"] = ratio("fr torch", oop_base)
        row["ratio"]["fr torch / C out of place"] = ratio("fr torch", samples["C out of place"])
        row["ratio"]["busbw fr / C out of place"] = 1 / row["ratio"]["fr torch / C out of place"]
    return row


OOP = ("C out of place", "torch.empty_like", "fr torch")
BUSBW = ("C floor", "fr_ torch", "fr torch", "gloo")


def print_table(meta: dict, rows: list[dict]) -> None:
    print(f"# fastreduce {meta['fastreduce']} allreduce benchmark, {meta['date']}")
    print(f"# {meta['ranks']} ranks on {meta['nodes']} node(s), {meta['machine']}; "
          f"{meta['mpi']}; torch {meta['torch']}")
    print(f"# float32 sum; latency = average over ranks (us), median of {meta['repeat']} runs; "
          f"(ratio) within each run, median:")
    print("#   in place vs C floor; 'fr torch' vs C out of place + torch.empty_like")
    names = list(rows[0]["lat_us"])
    oop = set(OOP) <= set(names)
    shown = [n for n in names if not (oop and n in OOP[:2])]
    if oop:
        shown.insert(shown.index("fr torch"), "C oop+empty")
    bws = [n for n in BUSBW if n in names]
    print(f"{'size':>8} " + " ".join(f"{n:>16}" for n in shown) + " "
          + " ".join(f"{'busbw ' + n.split()[0]:>10}" for n in bws) + f" {'#wrong':>6}")
    for row in rows:
        lat, ratio, bw = row["lat_us"], row["ratio"], row["busbw_GBps"]
        cells = []
        for name in shown:
            if name == "C oop+empty":
                value = lat["C out of place"]["avg"] + lat["torch.empty_like"]["avg"]
                cells.append(f"{value:16.2f}")
            elif name in ratio:
                cells.append(f"{lat[name]['avg']:9.2f} ({ratio[name]:4.2f}x)".rjust(16))
            else:
                cells.append(f"{lat[name]['avg']:16.2f}")
        print(f"{format_size(row['bytes'], exact=False):>8} " + " ".join(cells) + " "
              + " ".join(f"{bw[n]:10.3f}" for n in bws) + f" {sum(row['wrong'].values()):6d}")
    small = [r for r in rows if r["bytes"] <= 1024]
    large = [r for r in rows if r["bytes"] >= 1 << 20]
    up = [r for r in rows if r["bytes"] >= 1024]
    print("# targets:")
    if "fr_ torch" in rows[0]["ratio"]:
        if small:
            worst = max(r["ratio"]["fr_ torch"] for r in small)
            print(f"#   in place, 4 B-1 KiB: worst {worst:.2f}x the C floor (target <= 2.0x)")
        if up:
            worst = max(up, key=lambda r: r["ratio"]["fr_ torch"])
            print(f"#   in place, >= 1 KiB: worst {worst['ratio']['fr_ torch']:.3f}x the C floor "
                  f"(at {format_size(worst['bytes'], exact=False)}; target <= 1.05x)")
        if large:
            worst = min(r["ratio"]["busbw fr_ / C floor"] for r in large)
            print(f"#   in place, >= 1 MiB: busbw at least {worst:.2f}x the C floor's "
                  f"(target >= 0.95x)")
    if "fr torch" in rows[0]["ratio"]:
        if small:
            worst = max(r["ratio"]["fr torch"] for r in small)
            print(f"#   out of place, 4 B-1 KiB: worst {worst:.2f}x C + empty_like "
                  f"(target <= 1.3x)")
        if large:
            worst = min(r["ratio"]["busbw fr / C out of place"] for r in large)
            print(f"#   out of place, >= 1 MiB: busbw at least {worst:.2f}x C out of place's "
                  f"(target >= 0.95x)")
    total = sum(sum(r["wrong"].values()) for r in rows)
    print(f"# correctness check after timing: {total} wrong elements")


if __name__ == "__main__":
    sys.exit(main())
