"""The command line: the argument parser, the checks of the arguments (the same on every
rank), and `main`, which prints the table."""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
from mpi4py import MPI

import fastreduce

from ... import sizes, topology
from ..._abi import first_line
from ...errors import UsageError
from . import collectives, floor
from .measure import _measure, _measure_collective
from .output import _unwritable, _write_outputs
from .peers import COLLECTIVE_PEERS, DEFAULT_COLLECTIVE_PEERS, PEERS, _init_torch, _torch_version
from .progress import _Progress
from .reference import DTYPES, ITEMSIZE, OPS


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_size(text: str) -> int:
    """`fastreduce.sizes.parse_size`, a bad size raising UsageError."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


DESCRIPTION = "fastreduce-bench: an osu_allreduce / nccl-tests style all-reduce benchmark."


def build_parser() -> argparse.ArgumentParser:
    """fastreduce-bench's argument parser; a usage error raises UsageError."""
    parser = _Parser(prog="fastreduce-bench", description=DESCRIPTION,
                     epilog=collectives.help_text(),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--collective", default="allreduce", choices=collectives.NAMES,
                        help="the collective to time (default allreduce); the others time "
                        "fastreduce's call with out= given (broadcast and reduce: in place) "
                        "beside the C floor and mpi4py (--peers), with nccl-tests' sizes and "
                        "busbw (below)")
    parser.add_argument("-b", "--minbytes", default="4", help="smallest message (4, 1K, 1M)")
    parser.add_argument("-e", "--maxbytes", default="64M", help="largest message")
    parser.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size factor")
    parser.add_argument("-d", "--dtype", default="float32", choices=DTYPES)
    parser.add_argument("-o", "--op", choices=OPS,
                        help="the reduction (default sum; allreduce, reduce_scatter, reduce)")
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
    parser.add_argument("--peers", help="also time the C floor (the MPI call in a C loop, "
                        "bench/floor.c built with mpicc), mpi4py, torch.distributed on gloo "
                        "(torch) or on fastreduce's backend (torch-fastreduce), and/or "
                        "fastreduce with segmentation off (allreduce only): --peers c,mpi4py,"
                        "torch,torch-fastreduce,unsegmented (default: none for allreduce, "
                        "c,mpi4py for the other collectives)")
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
    """The message sizes in bytes, from -b to -e by -f, whole elements, no repeats."""
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
    coll = collectives.COLLECTIVES[args.collective]
    if args.collective != "allreduce":
        _check_collective(args, coll)
    elif args.op is None:
        args.op = "sum"
    if args.op is not None and not fastreduce.supports(args.dtype, args.op):
        raise UsageError(f"op {args.op!r} is not defined for dtype {args.dtype}")
    if args.device == "cuda":
        if args.buffers != "torch":
            raise UsageError("--device cuda needs --buffers torch")
        try:
            import torch  # optional and heavy: loaded only when used
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
    if args.peers is None:  # on a GPU, mpi4py is the same call staged by hand
        args.peers = ("" if args.collective == "allreduce" else "mpi4py" if args.device == "cuda"
                      else ",".join(DEFAULT_COLLECTIVE_PEERS))
        args.peers_given = False
    else:
        args.peers_given = True
    peers = [p for p in args.peers.split(",") if p]
    allowed = PEERS if args.collective == "allreduce" else COLLECTIVE_PEERS
    if any(p not in allowed for p in peers):
        raise UsageError(f"--peers {args.peers!r}: choose from {', '.join(allowed)}"
                         + ("" if args.collective == "allreduce"
                            else f" (-c {args.collective})"))
    if "c" in peers and args.device != "cpu":
        raise UsageError("--peers c times MPI on host memory: use --device cpu")
    typed = {"c"} if args.collective == "allreduce" else {"c", "mpi4py"}
    if coll.reduces and typed & set(peers) and collectives.mpi_datatype(args.dtype,
                                                                        True)[0] is None:
        raise UsageError(f"--peers c,mpi4py: this MPI has no datatype for {args.dtype}")
    if args.collective != "allreduce" and shape is not None and \
            {"torch", "torch-fastreduce"} & set(peers):
        raise UsageError("--peers torch,torch-fastreduce time the whole world: with -c "
                         f"{args.collective}, leave out --partition")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    return shape, axes, peers


def _check_collective(args, coll) -> None:
    """The options that only the all-reduce has; the op where the collective reduces."""
    if coll.reduces:
        args.op = args.op or "sum"
    elif args.op is not None:
        raise UsageError(f"-o/--op: -c {args.collective} does not reduce (the op is for "
                         f"allreduce, reduce_scatter and reduce)")
    for given, option in ((args.out_of_place, "--out-of-place"),
                          (args.nonblocking, "--nonblocking")):
        if given:
            raise UsageError(f"{option} is for -c allreduce only (-c {args.collective} "
                             f"times the blocking call, out= given)")


def _load_floor(args, world, peers: list[str]):
    """The C floor where --peers has c; None where not. Where it cannot be built: a usage
    error if --peers named it, else (the default columns) a note and no c column."""
    if "c" not in peers:
        return None, None
    try:
        return floor.load(world), None
    except floor.FloorUnavailable as exc:
        if args.peers_given:
            raise UsageError(f"--peers c: the C floor cannot be built here: {exc}") from None
        peers.remove("c")
        return None, f"# no C floor column: {exc}".replace("\n", "\n#   ")


def main(argv: list[str] | None = None) -> int:
    """Run fastreduce-bench on every rank; the exit status (0, 1 if anything was wrong, 2)."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        shape, axes, peers = check_args(args, world.Get_size())
        itemsize = ITEMSIZE[args.dtype]
        sizes = sizes_from(args, itemsize)
        if args.collective == "allreduce":
            plan = [(nbytes, max(1, nbytes // itemsize)) for nbytes in sizes]
        else:
            group = (math.prod(shape[a] for a in axes) if shape is not None
                     else world.Get_size())
            plan = collectives.rows_for(args.collective, sizes, itemsize, group)
        # rank 0 writes the files: its view of the file system decides, before any timing
        problem = world.bcast(_unwritable(args) if rank == 0 else None)
        if problem:
            raise UsageError(problem)
        lib, note = _load_floor(args, world, peers)
    except UsageError as exc:
        if rank == 0:
            parser.print_usage(sys.stderr)
            print(f"fastreduce-bench: error: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch  # optional and heavy: loaded only when used

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
    aware, how = fastreduce.gpupaths.cuda_aware()
    nodes = topology.gather()
    coll = collectives.COLLECTIVES[args.collective]
    redop = args.op if coll.reduces else "none"
    if args.collective == "allreduce":
        mode = (("out of place" if args.out_of_place else "in place")
                + (", non-blocking" if args.nonblocking else ", blocking"))
    else:
        mode = ("in place" if coll.in_place else "out of place (out= given)") + ", blocking"
    meta = {
        "fastreduce": fastreduce.__version__,
        "mpi": first_line(MPI.Get_library_version()),
        "ranks": world.Get_size(), **nodes.as_dict(), "topology": nodes.summary(),
        "communicator": where,
        "device": args.device, "buffers": args.buffers, "dtype": args.dtype, "op": redop,
        "mode": mode,
        "cuda_aware": f"{'yes' if aware else 'no'} ({how})",
        "torch": _torch_version(),
    }
    if args.collective != "allreduce":
        meta.update(collective=args.collective, mpi_call=coll.mpi, root=collectives.ROOT,
                    size_is=coll.size, count_is=coll.count, busbw_factor=coll.factor)
    gpu = args.device == "cuda"
    if gpu:
        meta["gpu_paths"] = fastreduce.gpupaths.gpu_path_settings()
        meta["gpu_modes"] = args.gpu_modes
    if rank == 0:
        print(f"# fastreduce-bench: fastreduce {meta['fastreduce']}, torch {meta['torch']}")
        print(f"# MPI: {meta['mpi']}")
        print(f"# {meta['topology']}; communicator: {where}")
        if nodes.nodes > 1:
            print(f"# nodes: {nodes.listing()}")
        for problem in nodes.problems:
            print(f"# WARNING: processor names and shared-memory groups disagree: {problem}")
        print(f"# device {args.device}, {args.buffers} buffers, {meta['mode']}; "
              f"CUDA-aware: {meta['cuda_aware']}")
        if args.collective != "allreduce":
            print(f"# collective {args.collective} ({coll.mpi}"
                  + (f", root {collectives.ROOT}" if coll.name in collectives.ROOTED else "")
                  + f"): size = {coll.size}, count = {coll.count}, busbw = algbw * "
                  f"{coll.factor} (nccl-tests' conventions)")
        if note:
            print(note)
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
    progress = _Progress.for_rank(rank, args, len(plan))
    measure = _measure if args.collective == "allreduce" else _measure_collective
    for index, (nbytes, count) in enumerate(plan):
        progress.size(index, nbytes)
        row = measure(args, comm, count, nbytes, p, peers, gloo, progress.step, lib)
        rows.append(row)
        if rank == 0:
            progress.clear()
            peer_cells = "".join(f" {row['peers'][name]:13.2f}" for name in peers)
            gpu_cells = ""
            if gpu:
                gpu_cells = f" {row['path']:>7}" + "".join(
                    f" {row['modes'][m]['avg_us']:11.2f} {row['modes'][m]['path']:>7}"
                    for m in args.gpu_modes[1:])
            print(f" {nbytes:>11} {count:>10} {args.dtype:>9} {redop:>6} "
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
        import torch.distributed as dist  # optional and heavy: loaded only when used

        dist.destroy_process_group()
    return 1 if wrong else 0
