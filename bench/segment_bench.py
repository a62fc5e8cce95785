"""Large all-reduces: one MPI_Allreduce call against fastreduce's segmented calls.

    mpiexec -n 4 python bench/segment_bench.py                 (NP ranks, this MPI)
    mpiexec -n 2 python bench/segment_bench.py --segments 0,1M,4M,16M --repeat 5
    mpiexec -n 2 python bench/segment_bench.py --form out-of-place

In one job, for each message size (float32 sum, numpy memory): the C floor (one
MPI_Allreduce in a C loop, bench/floor.c), then fastreduce with each segment size (0: one
call, as the floor). In place (default): the floor with MPI_IN_PLACE against allreduce_;
out of place: the floor into a buffer of its own against allreduce(out=) into one. Each
column is timed `--repeat` times interleaved, and each ratio to the floor is taken within a
repeat; medians are printed. Minor page faults per call (getrusage, this rank) show whether
the MPI maps fresh memory on every call.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import fastreduce
from fastreduce import runtime
from fastreduce._abi import first_line
from fastreduce.sizes import format_size, parse_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allreduce_bench import load_floor  # noqa: E402


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(comm, fn, iters: int) -> tuple[float, float]:
    """(seconds per call, slowest rank; minor page faults per call on this rank)."""
    fn()  # warm-up
    comm.Barrier()
    faults = minor_faults()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    seconds = (time.perf_counter() - start) / iters
    return comm.allreduce(seconds, op=MPI.MAX), (minor_faults() - faults) / iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M,32M,64M,128M,256M")
    parser.add_argument("--segments", default="0,1M,2M,4M,8M,16M")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--form", choices=("in-place", "out-of-place"), default="in-place")
    args = parser.parse_args()
    comm = fastreduce.default_comm()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    segments = [parse_size(s) for s in args.segments.split(",")]
    floor = load_floor(comm)
    fcomm = comm.py2f()
    old = runtime.segment_bytes()
    if comm.rank == 0:
        print(f"# fastreduce {fastreduce.__version__} segment benchmark: {comm.size} ranks; "
              f"{first_line(MPI.Get_library_version())}; {args.form}; median of {args.repeat}")
        print("# time of one call (ms, slowest rank) and, for fastreduce, the ratio to the C "
              "floor within each repeat; faults = minor page faults per call (rank 0)")
        head = "".join(f" {'seg ' + (format_size(s) if s else 'off'):>17}" for s in segments)
        print(f"#{'size':>9} {'C floor':>9} {'faults':>7}{head} {'faults':>7}")
    for nbytes in sizes:
        count = nbytes // 4
        data = np.ones(count, np.float32)
        out = np.empty_like(data) if args.form == "out-of-place" else None
        send, recv = (None, data) if out is None else (data, out)
        iters = max(3, min(50, (256 << 20) // nbytes))
        floor_times, floor_faults = [], []
        seg_times = {s: [] for s in segments}
        seg_ratio = {s: [] for s in segments}
        seg_faults = []
        for _ in range(args.repeat):
            t, f = timed(comm, lambda send=send, recv=recv, count=count: floor.floor_allreduce(
                fcomm, None if send is None else send.ctypes.data, recv.ctypes.data, count, 0,
                1), iters)
            floor_times.append(t)
            floor_faults.append(f)
            for s in segments:
                runtime.set_segment_bytes(s)
                if out is None:
                    def call(data=data):
                        fastreduce.allreduce_(data, comm=comm)
                else:
                    def call(data=data, out=out):
                        fastreduce.allreduce(data, comm=comm, out=out)
                ts, fs = timed(comm, call, iters)
                seg_times[s].append(ts)
                seg_ratio[s].append(ts / t)
                if s == segments[-1]:
                    seg_faults.append(fs)
            runtime.set_segment_bytes(old)
        data[:] = 1  # the sums grew; nothing here checks them (allreduce_bench does)
        if comm.rank == 0:
            cells = "".join(f" {statistics.median(seg_times[s]) * 1e3:9.2f} "
                            f"({statistics.median(seg_ratio[s]):4.2f}x)" for s in segments)
            print(f" {format_size(nbytes):>9} {statistics.median(floor_times) * 1e3:9.2f} "
                  f"{statistics.median(floor_faults):7.0f}{cells} "
                  f"{statistics.median(seg_faults):7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
