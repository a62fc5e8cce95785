"""fastreduce-bench: an osu_allreduce / nccl-tests style all-reduce benchmark.

    mpiexec -n 4 fastreduce-bench -b 8 -e 128M -f 2
    mpiexec -n 2 fastreduce-bench --device cuda --gpu-paths auto,direct,staged
    mpiexec -n 4 fastreduce-bench -c allgather -b 1K -e 256M
    srun -n 8 --mpi=pmix fastreduce-bench -d bfloat16 -o sum --partition 2x4 --axes 1
    python -m fastreduce.bench --help

For each size: a barrier, warm-up, timed iterations, latency (avg/min/max over
ranks), algbw = bytes / time, busbw = algbw * 2(p-1)/p, and a correctness
check after timing (#wrong: wrong elements over all ranks). On a GPU the path each size
took (direct or staged) is printed beside it, and --gpu-paths times several
FASTREDUCE_GPU_PATH modes in the same job (the first fills the main columns). The exit status is
1 when anything was wrong, 2 on a usage error (reported by rank 0; every rank
exits).

Rank 0 shows which size and column it is timing on a status line that each
table row replaces, where the launcher's output is a terminal (--progress forces it,
--no-progress turns it off); piped output and the --json/--csv files never hold
it. --plot FILE.png draws latency, algbw and busbw against message size (log
axes), one line per column: fastreduce, each extra GPU path mode, each peer.

-c times another collective (allgather, reduce_scatter, broadcast, alltoall, reduce,
gather, scatter: collectives.py) in the same table, with nccl-tests' sizes and busbw
factors, beside the C floor (bench/floor.c: floor.py) and mpi4py.
"""

from .cli import build_parser, main
from .peers import init_gloo
from .plots import plot

__all__ = ["build_parser", "init_gloo", "main", "plot"]
