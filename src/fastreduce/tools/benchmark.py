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

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time

import numpy as np

from .._abi import first_line
from .. import sizes
from ..errors import UsageError
from ..sizes import format_size

__all__ = ["main"]

ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "complex64": 8,
            "complex128": 16, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1,
            "bool": 1}
DTYPES = tuple(ITEMSIZE)
OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_size(text: str) -> int:
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fastreduce-bench", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--minbytes", default="4", help="smallest message (4, 1K, 1M)")
    parser.add_argument("-e", "--maxbytes", default="64M", help="largest message")
    parser.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size factor")
    parser.add_argument("-d", "--dtype", default="float32", choices=DTYPES)
    parser.add_argument("-o", "--op", default="sum", choices=OPS)
    parser.add_argument("-n", "--iters", type=int, default=0,
                        help="timed iterations (default 1000 up to 64 KiB, fewer above)")
    parser.add_argument("-w", "--warmup", type=int, default=0,
                        help="warm-up iterations (default a tenth of the timed ones)")
    parser.add_argument("--out-of-place", action="store_true",
                        help="allreduce(x) into a new tensor (default: in place, allreduce_)")
    parser.add_argument("--buffers", default="torch", choices=("torch", "numpy"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--gpu-paths", default="",
                        help="with --device cuda: the GPU path modes to time, e.g. "
                        "auto,direct,staged (default: the mode in force, FASTREDUCE_GPU_PATH); "
                        "the first fills the main columns")
    parser.add_argument("--nonblocking", action="store_true",
                        help="iallreduce + wait instead of the blocking call")
    parser.add_argument("--partition", help="a Cartesian partition of the ranks, e.g. 2x2x3")
    parser.add_argument("--axes", help="reduce over these axes of --partition, e.g. 1,2")
    parser.add_argument("--peers", default="", help="also time mpi4py, torch.distributed on "
                        "gloo (torch) or on fastreduce's backend (torch-fastreduce), and/or "
                        "fastreduce with segmentation off: --peers mpi4py,torch,"
                        "torch-fastreduce,unsegmented")
    parser.add_argument("--json", help="write every number to this file (rank 0)")
    parser.add_argument("--csv", help="write the table to this CSV file (rank 0)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw latency, algbw and busbw "
                        "against message size into this PNG, one line per column (rank 0; "
                        "needs matplotlib)")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--progress", action="store_true",
                       help="show the status line even where no terminal is detected "
                       "(e.g. under srun)")
    shown.add_argument("--no-progress", action="store_true",
                       help="no status line (default: one on rank 0 when the launcher's "
                       "output is a terminal)")
    parser.add_argument("--inject-wrong", action="store_true", help=argparse.SUPPRESS)
    return parser


def sizes_from(args, itemsize: int) -> list[int]:
    begin, end = parse_size(args.minbytes), parse_size(args.maxbytes)
    if begin <= 0 or end <= 0:
        raise UsageError("sizes must be positive")
    if begin > end:
        raise UsageError(f"the size range is reversed: -b {args.minbytes} is above "
                         f"-e {args.maxbytes}")
    if args.stepfactor <= 1:
        raise UsageError("-f/--stepfactor must be above 1")
    out, n = [], begin
    while n <= end:
        bytes_ = max(itemsize, n // itemsize * itemsize)
        if not out or bytes_ != out[-1]:
            out.append(bytes_)
        n = int(math.ceil(n * args.stepfactor))
    return out


def check_args(args, world_size: int):
    """Every check needs only the arguments and the world size: all ranks agree."""
    import fastreduce

    if not fastreduce.supports(args.dtype, args.op):
        raise UsageError(f"op {args.op!r} is not defined for dtype {args.dtype}")
    if args.device == "cuda":
        if args.buffers != "torch":
            raise UsageError("--device cuda needs --buffers torch")
        try:
            import torch
        except ImportError:
            raise UsageError("--device cuda needs torch with CUDA") from None
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: torch.cuda.is_available() is False here "
                             "(a CPU build of torch, or no visible GPU)")
    if args.buffers == "numpy" and args.dtype == "bfloat16":
        raise UsageError("numpy has no bfloat16: use --buffers torch")
    for n in (args.iters, args.warmup):
        if n < 0:
            raise UsageError("iteration counts cannot be negative")
    shape = axes = None
    if args.partition:
        try:
            shape = [int(v) for v in args.partition.lower().split("x")]
        except ValueError:
            raise UsageError(f"--partition {args.partition!r}: give a shape like 2x2x3") from None
        if any(n < 1 for n in shape) or math.prod(shape) != world_size:
            raise UsageError(f"--partition {args.partition} has {math.prod(shape)} workers but "
                             f"{world_size} ranks are running")
        try:
            axes = [int(v) for v in args.axes.split(",")] if args.axes else list(range(len(shape)))
        except ValueError:
            raise UsageError(f"--axes {args.axes!r}: give axes like 1,2") from None
        if any(not 0 <= a < len(shape) for a in axes) or len(set(axes)) != len(axes):
            raise UsageError(f"--axes {args.axes}: axes must be distinct and within "
                             f"0..{len(shape) - 1}")
    elif args.axes:
        raise UsageError("--axes needs --partition")
    modes = [m.strip() for m in args.gpu_paths.split(",") if m.strip()]
    if any(m not in ("auto", "direct", "staged") for m in modes) or len(set(modes)) != len(
            modes):
        raise UsageError(f"--gpu-paths {args.gpu_paths!r}: distinct modes from auto, direct, "
                         f"staged")
    if args.device != "cuda" and modes:
        raise UsageError("--gpu-paths needs --device cuda")
    args.gpu_modes = modes or [None]  # None: the mode in force
    peers = [p for p in args.peers.split(",") if p]
    if any(p not in PEERS for p in peers):
        raise UsageError(f"--peers {args.peers!r}: choose from {', '.join(PEERS)}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    return shape, axes, peers


def make_buffer(kind: str, dtype: str, count: int, device: str = "cpu"):
    if kind == "numpy":
        return np.zeros(count, dtype=dtype)
    import torch

    return torch.zeros(count, dtype=getattr(torch, dtype), device=device)


def fill(buf, values: np.ndarray) -> None:
    if isinstance(buf, np.ndarray):
        buf[:] = values.astype(buf.dtype)
    else:
        import torch

        buf.copy_(torch.from_numpy(values).to(buf.dtype))


def as_numpy(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf
    import torch

    if buf.dtype == torch.bfloat16:
        buf = buf.float()
    return buf.cpu().numpy()


def rank_values(dtype: str, op: str, rank: int, count: int) -> np.ndarray:
    """Small, exactly representable inputs of one rank for the correctness check."""
    if dtype == "bool":
        return (np.arange(count) + rank) % 3 != 0
    if op in ("band", "bor", "bxor"):
        return ((np.arange(count) + rank) % 7 + 1).astype(np.int64)
    if op == "prod":
        return np.where((np.arange(count) + rank) % 5 == 0, 2.0, 1.0)
    return ((np.arange(count) + rank) % 4 + 1).astype(np.float64)


def expected(dtype: str, op: str, size: int, count: int) -> np.ndarray:
    stack = np.stack([rank_values(dtype, op, r, count) for r in range(size)])
    if op in ("sum", "avg"):
        out = stack.sum(axis=0)
        return out / size if op == "avg" else out
    if op == "prod":
        return stack.prod(axis=0)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    logical = stack.dtype == bool
    fn = {"band": np.logical_and if logical else np.bitwise_and,
          "bor": np.logical_or if logical else np.bitwise_or,
          "bxor": np.logical_xor if logical else np.bitwise_xor}[op]
    return fn.reduce(stack, axis=0)


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    import fastreduce

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        shape, axes, peers = check_args(args, world.Get_size())
        itemsize = ITEMSIZE[args.dtype]
        sizes = sizes_from(args, itemsize)
        # rank 0 writes the files: its view of the file system decides, before any timing
        problem = world.bcast(_unwritable(args) if rank == 0 else None)
        if problem:
            raise UsageError(problem)
    except UsageError as exc:
        if rank == 0:
            parser.print_usage(sys.stderr)
            print(f"fastreduce-bench: error: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        torch.cuda.set_device(fastreduce.local_rank() % torch.cuda.device_count())
    if shape is not None:
        P = fastreduce.Partition().create_cartesian_topology_partition(shape)
        comm = P.sub(axes)
        where = f"partition {shape}, axes {tuple(axes)} ({comm.Get_size()} ranks per group)"
    else:
        comm = fastreduce.default_comm()
        where = "all ranks"
    p = comm.Get_size()
    gloo = _init_torch(world, peers)
    aware, how = fastreduce.runtime.cuda_aware()
    nodes = len(set(world.allgather(MPI.Get_processor_name())))
    meta = {
        "fastreduce": fastreduce.__version__,
        "mpi": first_line(MPI.Get_library_version()),
        "ranks": world.Get_size(), "nodes": nodes, "communicator": where,
        "device": args.device, "buffers": args.buffers, "dtype": args.dtype, "op": args.op,
        "mode": ("out of place" if args.out_of_place else "in place")
        + (", non-blocking" if args.nonblocking else ", blocking"),
        "cuda_aware": f"{'yes' if aware else 'no'} ({how})",
        "torch": _torch_version(),
    }
    gpu = args.device == "cuda"
    if gpu:
        meta["gpu_paths"] = fastreduce.gpupath.gpu_path_settings()
        meta["gpu_modes"] = args.gpu_modes
    if rank == 0:
        print(f"# fastreduce-bench: fastreduce {meta['fastreduce']}, torch {meta['torch']}")
        print(f"# MPI: {meta['mpi']}")
        print(f"# {meta['ranks']} ranks on {meta['nodes']} node(s); communicator: {where}")
        print(f"# device {args.device}, {args.buffers} buffers, {meta['mode']}; "
              f"CUDA-aware: {meta['cuda_aware']}")
        if gpu:
            settings = meta["gpu_paths"]
            timed = ", ".join(m or settings["mode"] for m in args.gpu_modes)
            print(f"# GPU path modes timed: {timed}; device pointers to MPI: "
                  f"{settings['device pointers']}")
        peer_head = "".join(f" {name + '(us)':>13}" for name in peers)
        gpu_head = (f" {'path':>7}" + "".join(f" {m + '(us)':>11} {'path':>7}"
                                               for m in args.gpu_modes[1:])) if gpu else ""
        print(f"#{'size(B)':>11} {'count':>10} {'type':>9} {'redop':>6} {'avg(us)':>10} "
              f"{'min(us)':>10} {'max(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
              f"{'#wrong':>7}{gpu_head}{peer_head}")
    rows = []
    progress = _Progress.for_rank(rank, args, len(sizes))
    for index, nbytes in enumerate(sizes):
        count = max(1, nbytes // itemsize)
        progress.size(index, nbytes)
        row = _measure(args, comm, count, nbytes, p, peers, gloo, progress.step)
        rows.append(row)
        if rank == 0:
            progress.clear()
            peer_cells = "".join(f" {row['peers'][name]:13.2f}" for name in peers)
            gpu_cells = ""
            if gpu:
                gpu_cells = f" {row['path']:>7}" + "".join(
                    f" {row['modes'][m]['avg_us']:11.2f} {row['modes'][m]['path']:>7}"
                    for m in args.gpu_modes[1:])
            print(f" {nbytes:>11} {count:>10} {args.dtype:>9} {args.op:>6} "
                  f"{row['avg_us']:10.2f} {row['min_us']:10.2f} {row['max_us']:10.2f} "
                  f"{row['algbw']:12.3f} {row['busbw']:12.3f} {row['wrong']:>7}{gpu_cells}"
                  f"{peer_cells}", flush=True)
    wrong = sum(r["wrong"] for r in rows)
    if rank == 0:
        progress.clear()
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'WRONG'}")
        print(f"# Avg bus bandwidth    : {np.mean([r['busbw'] for r in rows]):.3f} GB/s")
        _write_outputs(args, meta, rows, peers, p)
    if gloo is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 1 if wrong else 0


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "not installed"
    return torch.__version__


PEERS = ("mpi4py", "torch", "torch-fastreduce", "unsegmented")


def _init_torch(world, peers) -> dict | None:
    """torch.distributed for the torch peers: {peer: its process group}, or None."""
    if "torch-fastreduce" not in peers:
        return {"torch": _init_gloo(world)} if "torch" in peers else None
    import torch.distributed as dist

    from ..torch import distributed  # noqa: F401  (registers the backend)

    dist.init_process_group("fastreduce")
    groups = {"torch-fastreduce": dist.group.WORLD}
    if "torch" in peers:
        groups["torch"] = dist.new_group(backend="gloo")
    return groups


def _init_gloo(world):
    import socket

    import torch.distributed as dist

    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port)
    host = world.bcast(socket.gethostname() if world.Get_rank() == 0 else None)
    address = "127.0.0.1" if host == socket.gethostname() else host
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())
    return dist.group.WORLD


def _iterations(args, nbytes: int) -> tuple[int, int]:
    iters = args.iters or (1000 if nbytes <= 64 << 10 else
                           max(10, 100 * (1 << 20) // max(nbytes, 1 << 20)))
    return iters, args.warmup or max(2, iters // 10)


def _measure(args, comm, count: int, nbytes: int, p: int, peers, gloo,
             step=lambda what: None) -> dict:
    """One size: every column's timing, and the correctness check; step(what) names each
    part as it starts (rank 0's status line)."""
    import fastreduce

    x = make_buffer(args.buffers, args.dtype, count, args.device)
    iters, warmup = _iterations(args, nbytes)
    op = args.op
    if args.nonblocking:
        start = fastreduce.iallreduce if args.out_of_place else fastreduce.iallreduce_

        def call():
            start(x, op, comm=comm).wait()
    elif args.out_of_place:
        def call():
            fastreduce.allreduce(x, op, comm=comm)
    else:
        def call():
            fastreduce.allreduce_(x, op, comm=comm)
    modes = {}
    for mode in (args.gpu_modes if args.device == "cuda" else ["auto"]):
        step(f"fastreduce ({mode})" if mode and len(args.gpu_modes) > 1 else "fastreduce")
        modes[mode] = _time_mode(args, comm, call, iters, warmup, mode)
    main = modes[args.gpu_modes[0] if args.device == "cuda" else "auto"]
    times = main["times"]
    avg = sum(times) / len(times)
    bus = 2 * (p - 1) / p if p > 1 else 0.0
    row = {"bytes": nbytes, "count": count, "avg_us": avg * 1e6, "min_us": min(times) * 1e6,
           "max_us": max(times) * 1e6, "algbw": nbytes / avg / 1e9,
           "busbw": nbytes / avg / 1e9 * bus, "peers": {}}
    if args.device == "cuda":
        row["path"] = main["path"]
        row["modes"] = {m: {"avg_us": sum(v["times"]) / len(v["times"]) * 1e6,
                            "path": v["path"]} for m, v in modes.items()}
    # correctness after timing
    step("checking")
    fill(x, rank_values(args.dtype, op, comm.Get_rank(), count))
    if args.nonblocking:
        result = start(x, op, comm=comm).wait()
    elif args.out_of_place:
        result = fastreduce.allreduce(x, op, comm=comm)
    else:
        result = fastreduce.allreduce_(x, op, comm=comm)
    got = as_numpy(result).astype(np.float64 if args.dtype != "bool" else bool)
    want = expected(args.dtype, op, p, count)
    if args.dtype not in ("bool",):
        want = as_numpy(_rounded(args.buffers, args.dtype, want)).astype(np.float64)
    if args.inject_wrong and comm.Get_rank() == 0:
        got = got.copy()
        got[0] = not got[0] if got.dtype == bool else got[0] + 1
    mine = int(np.count_nonzero(got != want))
    row["wrong"] = comm.allreduce(mine)
    for name in peers:
        step(name)
        row["peers"][name] = _time_peer(name, args, comm, count, iters, warmup, gloo,
                                        call) * 1e6
    return row


def _time_mode(args, comm, call, iters: int, warmup: int, mode: str) -> dict:
    """Every rank's seconds per call in a GPU path mode (None: the one in force), and the
    path the timed calls took: direct, staged, or mixed (from fastreduce's path counters)."""
    if args.device != "cuda":
        return {"times": comm.allgather(_time(comm, call, iters, warmup)), "path": ""}
    from .. import runtime

    if mode is not None:
        runtime.set_gpu_path(mode)
    try:
        for _ in range(warmup):  # a calibration (auto, first use) happens here, untimed
            call()
        runtime.reset_gpu_copy_counts()
        t = _time(comm, call, iters, 0, args.device)
        counts = runtime.gpu_copy_counts()
    finally:
        if mode is not None:
            runtime.set_gpu_path(None)
    direct = comm.allreduce(counts["direct_calls"])
    staged = comm.allreduce(counts["staged_calls"])
    path = "mixed" if direct and staged else "direct" if direct else "staged"
    return {"times": comm.allgather(t), "path": path}


def _rounded(buffers: str, dtype: str, values: np.ndarray):
    buf = make_buffer(buffers, dtype, values.size)  # rounding as on the host
    fill(buf, values)
    return buf


def _time(comm, fn, iters: int, warmup: int, device: str = "cpu") -> float:
    """Seconds per fn() on this rank; on a GPU, until the device has finished the work."""
    sync = _device_sync(device)
    for _ in range(warmup):
        fn()
    sync()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def _device_sync(device: str):
    if device == "cpu":
        return lambda: None
    import torch

    return torch.cuda.synchronize


def _time_peer(name: str, args, comm, count: int, iters: int, warmup: int, gloo,
               call=None) -> float:
    from mpi4py import MPI

    if name == "unsegmented":  # fastreduce's own call with one MPI call per all-reduce
        from .. import runtime

        old = runtime.set_segment_bytes(0)
        try:
            t = _time(comm, call, iters, warmup, args.device)
        finally:
            runtime.set_segment_bytes(old)
    elif name == "mpi4py":
        ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
               "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR, "avg": MPI.SUM}
        dtype = "float32" if args.dtype == "bfloat16" else args.dtype
        if args.device == "cpu":
            buf = np.zeros(count, dtype=dtype)
            t = _time(comm, lambda: comm.Allreduce(MPI.IN_PLACE, buf, ops[args.op]), iters,
                      warmup)
        else:
            # what a user writes without fastreduce: copy to pinned host memory, mpi4py,
            # copy back (float32 standing in for bfloat16, as on the host)
            import torch

            dev = torch.zeros(count, dtype=getattr(torch, dtype), device=args.device)
            host = torch.zeros(count, dtype=dev.dtype, pin_memory=True)
            view = host.numpy()

            def staged():
                host.copy_(dev)
                comm.Allreduce(MPI.IN_PLACE, view, ops[args.op])
                dev.copy_(host, non_blocking=True)

            t = _time(comm, staged, iters, warmup, args.device)
    else:
        import torch
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
               "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM,
               "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
        t_buf = torch.zeros(count, dtype=getattr(torch, args.dtype), device=args.device)
        # torch.distributed reduces over the whole world: with --partition this column
        # is the world-wide all-reduce, which the JSON says
        group = gloo[name]
        t = _time(comm, lambda: dist.all_reduce(t_buf, ops[args.op], group=group), iters,
                  warmup, args.device)
    return comm.allreduce(t) / comm.Get_size()


def _unwritable(args) -> str | None:
    """Why an output file could not be written at the end of the run, or None."""
    for option in ("json", "csv", "plot"):
        path = getattr(args, option)
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            return f"--{option} {path}: the folder {folder} does not exist"
        if not os.access(folder, os.W_OK):
            return f"--{option} {path}: the folder {folder} is not writable"
    return None


def _write_outputs(args, meta: dict, rows: list[dict], peers, group_size: int) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["size_bytes", "count", "dtype", "op", "avg_us", "min_us", "max_us",
                             "algbw_GBps", "busbw_GBps", "wrong", *[f"{p}_us" for p in peers]])
            for r in rows:
                writer.writerow([r["bytes"], r["count"], args.dtype, args.op, r["avg_us"],
                                 r["min_us"], r["max_us"], r["algbw"], r["busbw"], r["wrong"],
                                 *[r["peers"][p] for p in peers]])
    if args.plot:
        plot(args.plot, meta, rows, peers, group_size)


# ---------------------------------------------------------------------------------------
# rank 0's status line

# the names a launcher's process has (/proc/PID/stat); Open MPI 5's mpiexec is prterun
LAUNCHERS = frozenset({"mpiexec", "mpirun", "prterun", "orterun", "mpiexec.hydra",
                       "mpirun.hydra", "mpiexec.openmpi", "mpirun.openmpi", "mpiexec.mpich",
                       "mpirun.mpich"})


def _is_terminal(pid: int, fd: int) -> bool:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty")) or target == "/dev/console"


def _launcher_terminals(depth: int = 8) -> tuple[bool, bool] | None:
    """Whether the stdout and stderr of the mpiexec that started this process are
    terminals, from /proc (Linux); None where no launcher is found among its ancestors."""
    pid = os.getppid()
    for _ in range(depth):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        if stat[stat.index("(") + 1:stat.rindex(")")] in LAUNCHERS:
            return _is_terminal(pid, 1), _is_terminal(pid, 2)
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return None


def terminals() -> tuple[bool, bool]:
    """Whether what this rank writes to stdout and stderr ends on a terminal.

    A rank's own isatty() does not say: Open MPI gives every rank's stdout a
    pseudo-terminal even when mpiexec's output is piped, and its stderr (MPICH: both)
    a pipe even on a terminal. The launcher's own descriptors do say; where it is not
    an ancestor (srun, a remote daemon) a rank's stdout counts only outside Open MPI.
    """
    found = _launcher_terminals()
    if found is not None:
        return found
    open_mpi = "OMPI_COMM_WORLD_SIZE" in os.environ
    return (not open_mpi and os.isatty(1)), os.isatty(2)


class _Progress:
    """One status line, "# [3/12] 64 KiB: mpi4py, 5 s", that rank 0 rewrites in place.

    On stdout, where the table goes, so that the two cannot interleave (a launcher
    forwards stdout and stderr separately); on stderr where only stderr is a terminal
    (the table going to a file). Every write ends its line, since Open MPI forwards
    whole lines only: a rewrite first moves the cursor back up and erases the status
    line, and so does the table row that takes its place."""

    ERASE = "\033[A\r\033[K"  # cursor up one line, to its start, erase it

    def __init__(self, stream=None, total: int = 0):
        self.stream, self.total = stream, total
        self.index, self.nbytes, self.started = 0, 0, time.perf_counter()
        self.shown = False

    @classmethod
    def for_rank(cls, rank: int, args, total: int) -> _Progress:
        if rank != 0 or args.no_progress:
            return cls()
        if args.progress:
            return cls(sys.stdout, total)
        out, err = terminals()
        return cls(sys.stdout if out else sys.stderr if err else None, total)

    def size(self, index: int, nbytes: int) -> None:
        self.index, self.nbytes = index, nbytes

    def step(self, what: str) -> None:
        if self.stream is None:
            return
        elapsed = time.perf_counter() - self.started
        self.stream.write(f"{self.ERASE if self.shown else ''}# [{self.index + 1}/{self.total}]"
                          f" {format_size(self.nbytes, exact=False)}: {what}, {elapsed:.0f} s\n")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        """Erase the status line: what is printed next takes its place."""
        if self.shown:
            self.stream.write(self.ERASE)
            self.shown = False


# ---------------------------------------------------------------------------------------
# --plot

def _columns(meta: dict, rows: list[dict], peers, group_size: int) -> list[tuple]:
    """(label, latency in us per row, busbw factor, is fastreduce) for every column."""
    def factor(p):
        return 2 * (p - 1) / p if p > 1 else 0.0

    modes = meta.get("gpu_modes") or [None]
    first = modes[0] or (meta.get("gpu_paths") or {}).get("mode")
    label = f"fastreduce ({first})" if len(modes) > 1 and first else "fastreduce"
    out = [(label, [r["avg_us"] for r in rows], factor(group_size), True)]
    for mode in modes[1:]:
        out.append((f"fastreduce ({mode})", [r["modes"][mode]["avg_us"] for r in rows],
                    factor(group_size), True))
    whole = meta.get("communicator", "all ranks") == "all ranks"
    for name in peers:
        if name.startswith("torch") and not whole:  # torch.distributed: the whole world
            out.append((f"{name} (all {meta['ranks']} ranks)",
                        [r["peers"][name] for r in rows], factor(meta["ranks"]), False))
        else:
            out.append((name, [r["peers"][name] for r in rows], factor(group_size),
                        name == "unsegmented"))
    return out


def _size_ticks(lo: float, hi: float) -> list[int]:
    """Powers of two from about lo to hi, evenly spaced in doublings: 4 to 6 from the
    smallest size to the largest where the spacing allows, else at most 5 from the smallest."""
    first, last = math.ceil(math.log2(lo) - 0.01), math.floor(math.log2(hi) + 0.01)
    if first > last:  # no power of two in range (one size, not a power of two): the sizes
        return sorted({int(lo), int(hi)})
    first, span = max(first, 0), max(last - max(first, 0), 0)
    step = next((s for s in range(1, span + 1) if span % s == 0 and 3 <= span // s <= 5),
                None) or next(s for s in range(1, span + 2) if span // s <= 4)
    return [1 << e for e in range(first, first + span + 1, step)]


def _log_y(ax, values) -> None:
    """Log y axis with plain numbers (0.5, 1, 2, 5, 10), enough of them to read a value."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    good = [v for v in values if v > 0 and math.isfinite(v)]
    decades = math.log10(max(good) / min(good)) if good else 0
    subs = (1.0, 2.0, 5.0) if decades < 2.5 else (1.0, 3.0) if decades < 4 else (1.0,)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot(path: str, meta: dict, rows: list[dict], peers=(), group_size: int | None = None):
    """Latency, algbw and busbw against message size, log axes, one line per column (the
    same colour and marker in each panel), the legend below the panels. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    group_size = group_size or meta["ranks"]
    sizes = [r["bytes"] for r in rows]
    columns = _columns(meta, rows, peers, group_size)
    fig, (lat, alg, bus) = plt.subplots(1, 3, figsize=(13, 4.6), sharex=True)
    markers = "osD^vP*Xhp"
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    nan = float("nan")
    values = {lat: [], alg: [], bus: []}
    for i, (label, us, factor, ours) in enumerate(columns):
        style = dict(color=colours[i % len(colours)], marker=markers[i % len(markers)],
                     markersize=4.5, linewidth=2.2 if i == 0 else 1.4,
                     linestyle="-" if ours else "--", label=label)
        us = [u if u > 0 and math.isfinite(u) else nan for u in us]
        algbw = [n / (u * 1e-6) / 1e9 for n, u in zip(sizes, us, strict=True)]
        busbw = [a * factor if factor else nan for a in algbw]
        for ax, ys in ((lat, us), (alg, algbw), (bus, busbw)):
            ax.plot(sizes, ys, **style)
            values[ax] += ys
    lat.set_title("latency (lower is better)", fontsize=10)
    alg.set_title("algbw = size / time", fontsize=10)
    bus.set_title("busbw = algbw \u00b7 2(p\u22121)/p  (nccl-tests)", fontsize=10)
    lat.set_ylabel("time per all-reduce (\u00b5s)")
    alg.set_ylabel("algbw (GB/s, 10\u2079 bytes/s)")
    bus.set_ylabel("busbw (GB/s, 10\u2079 bytes/s)")
    ticks = _size_ticks(min(sizes), max(sizes))
    for ax in (lat, alg, bus):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(v, exact=False)))
        ax.tick_params(axis="x", labelsize=9)
        ax.xaxis.set_minor_locator(LogLocator(base=2, subs=(1.0,), numticks=64))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("message size")
        ax.set_xlim(min(sizes) / 1.3, max(sizes) * 1.3)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", axis="y", alpha=0.12)
        if any(v == v for v in values[ax]):
            _log_y(ax, values[ax])
        else:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "busbw is 0 with 1 rank", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
    mpi = " ".join(meta["mpi"].split(",")[0].split())
    wrong = sum(1 for r in rows if r.get("wrong"))
    fig.text(0.5, 0.985, f"all-reduce of {meta['dtype']} ({meta['op']}), {meta['ranks']} "
             f"ranks on {meta['nodes']} node(s), {meta['communicator']}"
             + (f" \u2014 WRONG RESULTS at {wrong} size(s)" if wrong else ""),
             ha="center", va="top", fontsize=11, color="red" if wrong else "black")
    fig.text(0.5, 0.935, f"{mpi}; fastreduce {meta['fastreduce']}, torch {meta['torch']}; "
             f"{meta['device']}, {meta['buffers']} buffers, {meta['mode']}",
             ha="center", va="top", fontsize=8.5, color="0.3")
    handles, labels = lat.get_legend_handles_labels()
    legend_rows = math.ceil(len(labels) / 6)
    fig.legend(handles, labels, loc="lower center", ncol=math.ceil(len(labels) / legend_rows),
               frameon=False, fontsize=9.5, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.02 + 0.055 * legend_rows, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


if __name__ == "__main__":
    sys.exit(main())
