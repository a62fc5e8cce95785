"""fastreduce-bench: an osu_allreduce / nccl-tests style all-reduce benchmark.

    mpiexec -n 4 fastreduce-bench -b 8 -e 128M -f 2
    mpiexec -n 2 fastreduce-bench --device cuda --gpu-paths auto,direct,staged
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
"""

# ruff: noqa: F401  (re-exports)
# main is the tool; the other names are those the single-module benchmark had, kept
# reachable here (fastreduce.bench is this package) for the bench/ scripts and the tests
from ...errors import UsageError
from ...sizes import format_size
from .cli import _Parser, build_parser, check_args, main, parse_size, sizes_from
from .measure import _measure
from .output import _unwritable, _write_outputs
from .peers import PEERS, _init_gloo, _init_torch, _time_peer, _torch_version
from .plots import _columns, _log_y, _size_ticks, plot
from .progress import LAUNCHERS, _is_terminal, _launcher_terminals, _Progress, terminals
from .reference import (
    DTYPES,
    ITEMSIZE,
    OPS,
    _rounded,
    as_numpy,
    expected,
    fill,
    make_buffer,
    rank_values,
)
from .timing import _device_sync, _iterations, _time, _time_mode

__all__ = ["main"]
