"""What a collective that could raise at a deadline would cost: MPI cannot cancel a
collective, so such a call must be non-blocking and polled until it completes or the
deadline passes. This measures that against the blocking call, on numpy buffers through
mpi4py (the same MPI fastreduce uses), float32 sum:

  blocking   MPI_Allreduce
  wait       MPI_Iallreduce + MPI_Wait (no deadline possible: the reference for the next)
  polled     MPI_Iallreduce + MPI_Test in a loop: 1000 tests, then sleeps of 10 us doubling
             to 1 ms between tests (the torch.distributed backend's bounded barrier wait)

    mpiexec -n 2 python bench/bounded_wait_bench.py [--repeat 5] [--iters 20]

Each size: the three interleaved within every repetition, a barrier before each timed loop,
the slowest rank's mean per call; the table shows medians over repetitions and ratios to
the blocking call (taken per repetition, then the median)."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

SIZES = [64 << 10, 1 << 20, 16 << 20]


def polled(request: MPI.Request) -> None:
    for _ in range(1000):
        if request.Test():
            return
    pause = 1e-5
    while not request.Test():
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    kinds = {
        "blocking": lambda a, b: comm.Allreduce(a, b),
        "wait": lambda a, b: comm.Iallreduce(a, b).Wait(),
        "polled": lambda a, b: polled(comm.Iallreduce(a, b)),
    }
    if comm.rank == 0:
        print(f"# {MPI.Get_library_version().splitlines()[0]}, {comm.size} ranks, "
              f"{args.repeat} repetitions of {args.iters} calls")
        print(f"{'bytes':>10} {'blocking us':>12} {'wait us':>10} {'polled us':>10} "
              f"{'wait/blk':>9} {'polled/blk':>11}")
    for nbytes in SIZES:
        a = np.ones(nbytes // 4, np.float32)
        b = np.empty_like(a)
        times = {k: [] for k in kinds}
        for _ in range(args.repeat):
            for name, call in kinds.items():
                call(a, b)  # warm-up
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(args.iters):
                    call(a, b)
                mean = (time.perf_counter() - start) / args.iters
                times[name].append(comm.allreduce(mean, MPI.MAX))
        if comm.rank == 0:
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            ratio = {k: statistics.median(x / y for x, y in zip(v, times["blocking"],
                                                                  strict=True))
                     for k, v in times.items()}
            print(f"{nbytes:>10} {med['blocking']:12.1f} {med['wait']:10.1f} "
                  f"{med['polled']:10.1f} {ratio['wait']:9.2f} {ratio['polled']:11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
