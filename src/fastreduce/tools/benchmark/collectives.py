"""The collectives `fastreduce-bench -c` times (and bench/collectives_bench.py): for each,
nccl-tests' size convention and bus-bandwidth factor, the buffers of one size, and the call
of each column on them (fastreduce, mpi4py, the C floor, torch.distributed; on a GPU,
the same MPI call staged by hand), and the correctness check of fastreduce's call.

Sizes follow nccl-tests (src/<collective>.cu, GetCollByteCount and GetBw) exactly: the
size is the larger of a rank's send and receive buffers, i.e. the whole buffer for the
all-reduce, broadcast and reduce, and p parts for the others (the all-gather's receive
buffer, the reduce-scatter's send buffer, each rank's all-to-all buffers, the root's
gather and scatter buffers); count is nccl-tests' count argument (the whole buffer, or
one part: one rank's, or for the all-to-all one peer's); each part is whole 16-byte units
(nccl-tests' rounding down), at least one (where nccl-tests would time 0 bytes);
algbw = size / time and busbw = algbw * the collective's factor.
"""

from __future__ import annotations

import copy
import textwrap
import warnings
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

import fastreduce

from .reference import _rounded, as_numpy, expected, fill, make_buffer, rank_values


class Collective(NamedTuple):
    name: str
    mpi: str  # the MPI call
    factor: str  # busbw / algbw, as nccl-tests writes it
    reduces: bool  # takes an op (-o)
    divided: bool  # size = p parts of `count` elements
    in_place: bool  # fastreduce's call works on one buffer
    size: str  # what the size column is
    count: str  # what the count column is


COLLECTIVES = {c.name: c for c in (
    Collective("allreduce", "MPI_Allreduce", "2(p-1)/p", True, False, True,
               "the buffer", "all elements"),
    Collective("allgather", "MPI_Allgather", "(p-1)/p", False, True, False,
               "receive buffer: p parts", "a part (sent)"),
    Collective("reduce_scatter", "MPI_Reduce_scatter_block", "(p-1)/p", True, True, False,
               "send buffer: p parts", "a part (received)"),
    Collective("broadcast", "MPI_Bcast", "1", False, False, True, "the buffer",
               "all elements"),
    Collective("alltoall", "MPI_Alltoall", "(p-1)/p", False, True, False,
               "send (= receive) buffer: p parts", "a part (per peer)"),
    Collective("reduce", "MPI_Reduce", "1", True, False, True, "the buffer", "all elements"),
    Collective("gather", "MPI_Gather", "(p-1)/p", False, True, False,
               "root's receive buffer: p parts", "a part (sent)"),
    Collective("scatter", "MPI_Scatter", "(p-1)/p", False, True, False,
               "root's send buffer: p parts", "a part (received)"),
)}
NAMES = tuple(COLLECTIVES)
ROOT = 0  # of the rooted collectives: rank 0 of the communicator, as nccl-tests' default
ROOTED = ("broadcast", "reduce", "gather", "scatter")
MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
           "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR, "avg": MPI.SUM}


def bus_factor(name: str, p: int) -> float:
    """busbw / algbw for p ranks, nccl-tests' factor (0 where p - 1 is a factor of 0)."""
    factor = COLLECTIVES[name].factor
    if factor == "1":
        return 1.0
    return (2 if factor.startswith("2") else 1) * (p - 1) / p if p > 1 else 0.0


def help_text() -> str:
    """What --help says of -c: each collective's size, count and busbw factor."""
    wrap = textwrap.TextWrapper(width=88, break_on_hyphens=False)
    lines = wrap.wrap(
        "Collectives (-c), in nccl-tests' conventions exactly: the size (-b, -e and the size "
        "column) is the larger of a rank's send and receive buffers, count is nccl-tests' "
        "count (all elements, or one part: one rank's, for alltoall one peer's), algbw = "
        "size / time, busbw = algbw * factor, p = the ranks of the communicator:")
    lines.append(f"  {'-c':<16}{'size':<34}{'count':<21}busbw factor")
    for c in COLLECTIVES.values():
        lines.append(f"  {c.name:<16}{c.size:<34}{c.count:<21}{c.factor}")
    lines += wrap.wrap(
        "Parts are whole 16-byte units, as nccl-tests rounds them, but at least one (where "
        "nccl-tests would time 0 bytes). The root is rank 0. Besides allreduce, -c times "
        "fastreduce's call with out= given (broadcast and reduce: in place), and by default "
        "the C floor and mpi4py beside it (--peers c,mpi4py); with --device cuda, mpi4py's "
        "column is the same MPI call staged by hand: what the rank sends copied to pinned "
        "memory, mpi4py on it, what it receives copied back (--peers mpi4py).")
    return "\n".join(lines)


def part_count(count: int, p: int, itemsize: int) -> int:
    """nccl-tests' per-rank count of a divided collective of count elements: count / p,
    rounded down to whole 16-byte units (`& ~(16/eltSize - 1)`), at least one unit."""
    unit = max(1, 16 // itemsize)
    return max(unit, count // p // unit * unit)


def rows_for(name: str, sizes: list[int], itemsize: int, p: int) -> list[tuple[int, int]]:
    """(size in bytes, count) of each row: nccl-tests' size and count for each requested
    size, repeats dropped."""
    out: list[tuple[int, int]] = []
    for nbytes in sizes:
        count = max(1, nbytes // itemsize)
        if COLLECTIVES[name].divided:
            count = part_count(count, p, itemsize)
            nbytes = count * p * itemsize
        if not out or out[-1][0] != nbytes:
            out.append((nbytes, count))
    return out


def extents(name: str, count: int, p: int, rank: int) -> tuple[int | None, int | None]:
    """Elements of this rank's (x, out): x the buffer fastreduce's call reads (and, in
    place, writes), out the one it writes; None where this rank has none."""
    root = rank == ROOT
    return {
        "allreduce": (count, None),
        "broadcast": (count, None),
        "reduce": (count, None),
        "allgather": (count, p * count),
        "reduce_scatter": (p * count, count),
        "alltoall": (p * count, p * count),
        "gather": (count, p * count if root else None),
        "scatter": (p * count if root else None, count),
    }[name]


class Case:
    """One size's buffers: x and out as fastreduce's call takes them (numpy arrays or torch
    tensors of `dtype`); count as in `rows_for`."""

    def __init__(self, name: str, kind: str, dtype: str, count: int, comm, device="cpu"):
        self.name, self.kind, self.dtype, self.count = name, kind, dtype, count
        self.p, self.rank = comm.Get_size(), comm.Get_rank()
        nx, nout = extents(name, count, self.p, self.rank)
        self.x = None if nx is None else make_buffer(kind, dtype, nx, device)
        self.out = None if nout is None else make_buffer(kind, dtype, nout, device)


def fastreduce_call(case: Case, op: str | None, comm):
    """fastreduce's call on the case's buffers, as a function of no arguments."""
    x, out, name = case.x, case.out, case.name
    if name == "allreduce":
        return lambda: fastreduce.allreduce_(x, op, comm=comm)
    if name == "broadcast":
        return lambda: fastreduce.broadcast_(x, ROOT, comm=comm)
    if name == "reduce":
        return lambda: fastreduce.reduce_(x, op, ROOT, comm=comm)
    if name == "allgather":
        return lambda: fastreduce.allgather(x, comm=comm, out=out)
    if name == "reduce_scatter":
        return lambda: fastreduce.reduce_scatter(x, op, comm=comm, out=out)
    if name == "alltoall":
        return lambda: fastreduce.alltoall(x, comm=comm, out=out)
    if name == "gather":
        return lambda: fastreduce.gather(x, ROOT, comm=comm, out=out)
    return lambda: fastreduce.scatter(x, ROOT, comm=comm, out=out)


def numpy_case(name: str, dtype: str, count: int, comm) -> Case:
    """The case's buffers as numpy arrays for mpi4py and the C floor (float32 standing in
    for bfloat16, which numpy lacks, as in the all-reduce's mpi4py column)."""
    return Case(name, "numpy", "float32" if dtype == "bfloat16" else dtype, count, comm)


def mpi4py_call(case: Case, op: str | None, comm):
    """The same MPI call from mpi4py on numpy buffers (MPI.IN_PLACE where fastreduce's call
    is in place), as a function of no arguments."""
    x, out, name = case.x, case.out, case.name
    mop = MPI_OPS[op] if op else None
    if name == "allreduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, x, mop)
    if name == "broadcast":
        return lambda: comm.Bcast(x, ROOT)
    if name == "reduce":
        if case.rank == ROOT:
            return lambda: comm.Reduce(MPI.IN_PLACE, x, mop, ROOT)
        return lambda: comm.Reduce(x, None, mop, ROOT)
    if name == "allgather":
        return lambda: comm.Allgather(x, out)
    if name == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(x, out, mop)
    if name == "alltoall":
        return lambda: comm.Alltoall(x, out)
    if name == "gather":
        return lambda: comm.Gather(x, out, ROOT)
    return lambda: comm.Scatter(x, out, ROOT)


def by_hand_sides(name: str, rank: int) -> tuple[bool, str | None]:
    """Of the by-hand staged call on a GPU: (does this rank copy x to host memory first,
    which buffer it copies back: "x", "out" or None): only what it sends, only what it
    receives."""
    root = rank == ROOT
    sends = {"broadcast": root, "scatter": root}.get(name, True)
    receives = {"allreduce": "x", "broadcast": None if root else "x",
                "reduce": "x" if root else None, "gather": "out" if root else None,
                }.get(name, "out")
    return sends, receives


def staged_by_hand(name: str, dtype: str, count: int, op: str | None, comm, device):
    """What a user writes without fastreduce on CUDA tensors: what this rank sends copied
    to pinned host memory (which waits), the same MPI call from mpi4py on the pinned
    buffers, what it receives copied back on the stream, the stream synchronised before the
    host buffers are used again; a function of no arguments, on buffers of its own (float32
    standing in for bfloat16, as on the host)."""
    import torch  # optional and heavy: loaded only when used

    dev = Case(name, "torch", "float32" if dtype == "bfloat16" else dtype, count, comm,
               device)
    on_gpu = torch.device(device).type == "cuda"  # else a check of the steps on the CPU
    host = copy.copy(dev)
    host.kind = "numpy"
    pinned = {}
    for side in ("x", "out"):
        buf = getattr(dev, side)
        if buf is not None:
            pinned[side] = torch.zeros_like(buf, device="cpu")
            if on_gpu:
                pinned[side] = pinned[side].pin_memory()
            setattr(host, side, pinned[side].numpy())
    mpi_call = mpi4py_call(host, op, comm)
    sends, receives = by_hand_sides(name, dev.rank)
    back = None if receives is None else (getattr(dev, receives), pinned[receives])
    sync = torch.cuda.current_stream(device).synchronize if on_gpu else (lambda: None)

    def call():
        if sends:
            pinned["x"].copy_(dev.x)
        mpi_call()
        if back is not None:
            back[0].copy_(back[1], non_blocking=True)
            sync()

    return call


def mpi_datatype(dtype: str, reduces: bool):
    """(MPI datatype, elements per numpy element) of a numpy dtype: its own where mpi4py
    knows one; else, for data movement, bytes. None where a reduction has no type."""
    np_dtype = np.dtype("float32" if dtype == "bfloat16" else dtype)
    mtype = MPI._typedict.get(np_dtype.char)
    if mtype is not None and mtype != MPI.DATATYPE_NULL:
        return mtype, 1
    return (None, 0) if reduces else (MPI.BYTE, np_dtype.itemsize)


def c_timer(floor, case: Case, op: str | None, comm):
    """The C floor's loop of the same MPI call on numpy buffers: (warmup, iters) ->
    seconds per call on this rank."""
    x, out, name = case.x, case.out, case.name
    mtype, scale = mpi_datatype(case.dtype, COLLECTIVES[name].reduces)
    if mtype is None:
        raise ValueError(f"no MPI datatype for {case.dtype} here")
    fcomm, ftype, count = comm.py2f(), mtype.py2f(), case.count * scale
    fop = MPI_OPS[op].py2f() if op else 0
    xp = None if x is None else x.ctypes.data
    outp = None if out is None else out.ctypes.data
    in_root = case.rank == ROOT
    calls = {  # the all-reduce in place, or from x into out where the case has one
        "allreduce": lambda w, n: floor.floor_allreduce_typed(
            fcomm, xp if outp else None, outp or xp, count, ftype, fop, w, n),
        "broadcast": lambda w, n: floor.floor_bcast(fcomm, xp, count, ftype, ROOT, w, n),
        "reduce": lambda w, n: floor.floor_reduce(fcomm, None if in_root else xp,
                                                  xp if in_root else None, count, ftype,
                                                  fop, ROOT, w, n),
        "allgather": lambda w, n: floor.floor_allgather(fcomm, xp, outp, count, ftype, w, n),
        "reduce_scatter": lambda w, n: floor.floor_reduce_scatter_block(
            fcomm, xp, outp, count, ftype, fop, w, n),
        "alltoall": lambda w, n: floor.floor_alltoall(fcomm, xp, outp, count, ftype, w, n),
        "gather": lambda w, n: floor.floor_gather(fcomm, xp, outp, count, ftype, ROOT, w, n),
        "scatter": lambda w, n: floor.floor_scatter(fcomm, xp, outp, count, ftype, ROOT, w,
                                                    n),
    }
    call = calls[name]

    def timed(warmup: int, iters: int, _buffers=(x, out)) -> float:
        # _buffers: the arrays whose addresses C is given live as long as this function
        t = call(warmup, iters)
        if t < 0:
            raise MPI.Exception(int(-t))
        return t

    return timed


def torch_call(case: Case, op: str | None, group):
    """torch.distributed's call on the case's tensors in group, as a function of no
    arguments (the *_tensor and *_single forms, which take one flat tensor)."""
    import torch.distributed as dist  # optional and heavy: loaded only when used

    # torch 2.13 calls these two deprecated (for all_gather_single, reduce_scatter_single),
    # once per rank: the names users call today, timed without the noise
    warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\."
                            r"(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM, "band": dist.ReduceOp.BAND,
           "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
    x, out, name = case.x, case.out, case.name
    top = ops[op] if op else None
    # torch.distributed names roots by their global rank
    root = dist.get_global_rank(group, ROOT) if group is not None else ROOT
    if name == "allreduce":
        return lambda: dist.all_reduce(x, top, group=group)
    if name == "broadcast":
        return lambda: dist.broadcast(x, root, group=group)
    if name == "reduce":
        return lambda: dist.reduce(x, root, top, group=group)
    if name == "allgather":
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out, x, top, group=group)
    if name == "alltoall":
        return lambda: dist.all_to_all_single(out, x, group=group)
    if name == "gather":
        parts = list(out.chunk(case.p)) if out is not None else None
        return lambda: dist.gather(x, parts, root, group=group)
    parts = list(x.chunk(case.p)) if x is not None else None
    return lambda: dist.scatter(out, parts, root, group=group)


# --- the check after timing --------------------------------------------------------------

def _pattern(dtype: str, key: int, count: int) -> np.ndarray:
    """count small values, exactly representable in every dtype, that differ with key."""
    if dtype == "bool":
        return (np.arange(count) + key) % 3 != 0
    return ((np.arange(count) + 7 * key) % 61 + 1).astype(np.float64)


def check(case: Case, op: str | None, comm, inject_wrong: bool = False) -> int:
    """fastreduce's call once on rank-dependent inputs: this rank's wrong elements."""
    name, count, p, rank, dtype = case.name, case.count, case.p, case.rank, case.dtype
    x, out = case.x, case.out
    if out is not None:
        fill(out, np.zeros(out.shape[0], dtype=bool if dtype == "bool" else np.float64))
    result, want = out, None
    if name in ("allreduce", "reduce", "reduce_scatter"):
        fill(x, rank_values(dtype, op, rank, x.shape[0]))
        total = expected(dtype, op, p, x.shape[0])
        if name == "reduce_scatter":
            want = total[rank * count:(rank + 1) * count]
        elif name == "allreduce" or rank == ROOT:
            want, result = total, x
    elif name == "broadcast":
        fill(x, _pattern(dtype, 1, count) if rank == ROOT else
             np.zeros(count, dtype=bool if dtype == "bool" else np.float64))
        want, result = _pattern(dtype, 1, count), x
    elif name in ("allgather", "gather"):
        fill(x, _pattern(dtype, rank, count))
        if out is not None:
            want = np.concatenate([_pattern(dtype, r, count) for r in range(p)])
    elif name == "alltoall":
        fill(x, np.concatenate([_pattern(dtype, rank * p + j, count) for j in range(p)]))
        want = np.concatenate([_pattern(dtype, r * p + rank, count) for r in range(p)])
    else:  # scatter
        if x is not None:
            fill(x, np.concatenate([_pattern(dtype, r, count) for r in range(p)]))
        want = _pattern(dtype, rank, count)
    fastreduce_call(case, op, comm)()
    if want is None:  # a rank that receives nothing
        return 0
    got = as_numpy(result).astype(np.float64 if dtype != "bool" else bool)
    if dtype != "bool":
        want = as_numpy(_rounded(case.kind, dtype, want)).astype(np.float64)
    if inject_wrong and rank == 0:
        got = got.copy()
        got[0] = not got[0] if got.dtype == bool else got[0] + 1
    return int(np.count_nonzero(got != want))
