"""Horovod's data movement on CPU tensors against fastreduce's own calls, in one job.

    mpiexec -n 2 python bench/horovod_movement_bench.py [--repeat 5] [--device cuda]

For each of allgather, broadcast, alltoall and reducescatter at 64 KiB, 1 MiB and 16 MiB
(float32; the size is the per-rank message: allgather's input, reducescatter's output, what
alltoall sends to each rank, broadcast's tensor), the time of `fastreduce.horovod`'s call
(`hvd.allgather(x)`, `hvd.broadcast_(x, 0)`, `hvd.alltoall(x)`,
`hvd.reducescatter(x, op=hvd.Sum)`: matching by name, the result tensor made) and of
fastreduce's call on the same tensors (`allgather(x, out=)`, `broadcast_(x, 0)`,
`alltoall(x, out=)`, `reduce_scatter(x, out=)`), alternating within each repeat, with the
benchmark tool's timing harness; the ratio hvd / fastreduce is taken within each repeat
(median printed). With --device cuda the tensors are CUDA tensors (cuda:(local_rank %
device_count)), on the path fastreduce chooses for the MPI in use, and each timed loop ends
with the device synchronised.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from mpi4py import MPI

import fastreduce
import fastreduce.horovod as hvd
from fastreduce._abi import first_line
from fastreduce.tools.benchmark.timing import _iterations, _time

SIZES = (64 << 10, 1 << 20, 16 << 20)


def calls(name: str, nbytes: int, p: int, device: str = "cpu") -> tuple:
    """(hvd's call, fastreduce's call) of `name` with a per-rank message of nbytes."""
    n = nbytes // 4

    def ones(k):
        return torch.ones(k, device=device)

    def empty(k):
        return torch.empty(k, device=device)

    if name == "allgather":
        x, out = ones(n), empty(n * p)
        return (lambda: hvd.allgather(x)), (lambda: fastreduce.allgather(x, out=out))
    if name == "broadcast":
        x = ones(n)
        return (lambda: hvd.broadcast_(x, 0)), (lambda: fastreduce.broadcast_(x, 0))
    if name == "alltoall":
        x, out = ones(n * p), empty(n * p)
        return (lambda: hvd.alltoall(x)), (lambda: fastreduce.alltoall(x, out=out))
    x, out = ones(n * p), empty(n)
    return (lambda: hvd.reducescatter(x, op=hvd.Sum)), \
        (lambda: fastreduce.reduce_scatter(x, out=out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--iters", type=int, default=0, help="timed calls (default by size)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(fastreduce.local_rank() % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    hvd.init()
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    rows = []
    for name in ("allgather", "broadcast", "alltoall", "reducescatter"):
        for nbytes in SIZES:
            theirs, ours = calls(name, nbytes, p, device)
            iters, warmup = _iterations(argparse.Namespace(iters=args.iters, warmup=0),
                                        nbytes)
            t_hvd, t_fr, ratios = [], [], []
            for r in range(args.repeat):
                order = [("hvd", theirs), ("fr", ours)]
                if r % 2:
                    order.reverse()
                got = {}
                for label, fn in order:
                    got[label] = comm.allreduce(_time(comm, fn, iters, warmup,
                                                      args.device)) / p
                t_hvd.append(got["hvd"])
                t_fr.append(got["fr"])
                ratios.append(got["hvd"] / got["fr"])
            rows.append((name, nbytes, statistics.median(t_hvd) * 1e6,
                         statistics.median(t_fr) * 1e6, statistics.median(ratios)))
    if comm.Get_rank() == 0:
        print(f"Measured {time.strftime('%Y-%m-%d')} on {platform.node()} "
              f"({platform.machine()}), {p} ranks; {first_line(MPI.Get_library_version())}"
              f"; torch {torch.__version__}; {args.device} tensors"
              f"{' (' + torch.cuda.get_device_name() + ')' if device != 'cpu' else ''}"
              f"; time = the ranks' mean (us), median of "
              f"{args.repeat} repeats; ratio within each repeat, median")
        print()
        print("| call | size | hvd (us) | fastreduce (us) | hvd / fastreduce |")
        print("|---|---:|---:|---:|---:|")
        for name, nbytes, a, b, ratio in rows:
            size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            print(f"| {name} | {size} | {a:.1f} | {b:.1f} | {ratio:.2f} |")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
