"""The compiled core's data movement on 1-4 ranks: broadcast_, reduce_, allgather,
reduce_scatter, alltoall, gather, scatter, send and recv, on numpy arrays and torch CPU
tensors of several dtypes, against a reference that every rank builds from every rank's
seeded input (tests/support/reference.py), never from the code under test.

Each call is tried with out= given and out=None (a new tensor of x's type and dtype, in
rows of x's trailing shape), in place where it has an in-place form (allgather and gather:
x is this rank's slot of out; scatter: out is the root's slot of x), with uneven counts
(allgather, reduce_scatter, alltoall), empty tensors, a root other than 0, comm=None,
COMM_WORLD and a subcommunicator. A lowered int-count limit (the `count_limit` fixture)
sends broadcast_ and reduce_ in pieces and allgather, alltoall, gather and scatter through
an element-sized datatype; past it, reduce_scatter, allgather and alltoall refuse on every
rank. Bad input is refused on every rank, with the right exception, before any MPI call
(nothing enters the flight record) and with every tensor untouched; in debug mode, ranks
that pass different roots, dtypes, ops or counts, or uneven all-to-all counts that do not
pair up, get CollectiveMismatch on every rank.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from fake_dlpack import FakeTensor
from mpi4py import MPI
from reference import matches, reduce, values

import fastreduce

pytestmark = pytest.mark.timeout(60)  # a hang shows where, long before the job's guard

# (framework, dtype) of the movement cases; the reductions leave bool out (no sum or prod)
MOVE_CASES = [("torch", "float16"), ("torch", "bfloat16"), ("torch", "int8"),
              ("torch", "int64"), ("torch", "float64"), ("torch", "bool"),
              ("numpy", "float16"), ("numpy", "int8"), ("numpy", "int64"),
              ("numpy", "float64"), ("numpy", "bool")]
REDUCE_CASES = [(fw, dtype) for fw, dtype in MOVE_CASES if dtype != "bool"]
FLOATS = {"float16", "bfloat16", "float32", "float64"}


def case_params(pairs) -> list:
    return [pytest.param(fw, dtype, id=f"{fw}-{dtype}") for fw, dtype in pairs]


def ops_of(dtype: str) -> list[str]:
    return ["sum", "avg", "max", "prod"] if dtype in FLOATS else ["sum", "max", "prod"]


def roots(p: int) -> list[int]:
    """Rank 0 and the last rank (a root other than 0 where there are two ranks or more)."""
    return sorted({0, p - 1})


class Framework:
    """Tensors of one framework made from numpy values, and read back exactly."""

    def __init__(self, name: str) -> None:
        self.name = name

    def make(self, vals: np.ndarray, dtype: str):
        """A new contiguous tensor of `dtype` holding `vals` (rounded to the dtype)."""
        if self.name == "numpy":
            return np.ascontiguousarray(np.asarray(vals).astype(dtype))
        return torch.from_numpy(np.ascontiguousarray(vals)).to(getattr(torch, dtype))

    def np(self, t) -> np.ndarray:
        """A copy of a tensor's exact values (bfloat16 as float32, which holds them)."""
        if self.name == "numpy":
            return np.array(t)
        if t.dtype == torch.bfloat16:
            t = t.to(torch.float32)
        return t.numpy().copy()

    def wide(self, t) -> np.ndarray:
        """Values widened for a reference without intermediate rounding."""
        a = self.np(t)
        return a.astype(np.float64) if a.dtype.kind == "f" else a

    def assign(self, dst, src) -> None:
        """dst[...] = src, in dst's memory."""
        if self.name == "numpy":
            dst[...] = src
        else:
            dst.copy_(src)

    def is_new(self, result, like, dtype: str, shape: tuple) -> bool:
        """result is a tensor of like's type and `dtype`, of `shape`, not `like` itself."""
        if result is like or type(result) is not type(like) or tuple(result.shape) != shape:
            return False
        want = np.dtype(dtype) if self.name == "numpy" else getattr(torch, dtype)
        return result.dtype == want


@functools.cache
def framework(name: str) -> Framework:
    return Framework(name)


def raw(dtype: str, shape: tuple, rank: int, case: str) -> np.ndarray:
    """One rank's movement input before rounding: every bit pattern of ints, random bools,
    non-integral floats (a byte moved wrongly shows)."""
    op = "sum" if dtype in FLOATS else "bxor"
    return values(dtype, op, shape, rank, case, False)


def inputs(fw: Framework, dtype: str, shapes, case: str) -> list:
    """Every rank's input (shapes[r]: rank r's shape), as tensors."""
    return [fw.make(raw(dtype, shape, r, case), dtype) for r, shape in enumerate(shapes)]


def garbage(fw: Framework, dtype: str, shape: tuple, case: str):
    """A tensor of values unrelated to any input (an output the call must overwrite)."""
    return fw.make(raw(dtype, shape, -1, f"garbage {case}"), dtype)


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.array_equal(got, want)


# -- broadcast_ ---------------------------------------------------------------------------

@pytest.mark.parametrize("fw_name, dtype", case_params(MOVE_CASES))
def test_broadcast(fw_name, dtype, checks, comm):
    """x of the root into x on every rank, for each root and shape; returns x."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    for root in roots(p):
        for shape in [(3, 5), (1,), (), (0,)]:
            case = f"broadcast_ {fw_name} {dtype} root={root} {shape}"
            tensors = inputs(fw, dtype, [shape] * p, case)
            want = fw.np(tensors[root])
            x = tensors[rank]
            result = fastreduce.broadcast_(x, root)
            checks.check(result is x, f"{case}: broadcast_ did not return x")
            checks.check(same(fw.np(x), want), f"{case}: got {fw.np(x)}, expected {want}")


# -- allgather ----------------------------------------------------------------------------

def check_gathered(checks, case: str, fw: Framework, dtype: str, mode: str, x, out, result,
                   want: np.ndarray, x_before: np.ndarray) -> None:
    if mode == "new":
        checks.check(fw.is_new(result, x, dtype, want.shape),
                     f"{case}: out=None gave {type(result).__name__} "
                     f"{getattr(result, 'dtype', None)} {tuple(getattr(result, 'shape', ()))}, "
                     f"expected a new {type(x).__name__} {dtype} {want.shape}")
    else:
        checks.check(result is out, f"{case}: did not return out")
    got = fw.np(result)
    checks.check(same(got, want), f"{case}: got {got.ravel()[:8]}, expected {want.ravel()[:8]}")
    checks.check(same(fw.np(x), x_before), f"{case}: x was modified")


@pytest.mark.parametrize("mode", ["new", "out", "in_place"])
@pytest.mark.parametrize("fw_name, dtype", case_params(MOVE_CASES))
def test_allgather(fw_name, dtype, mode, checks, comm):
    """Equal parts: every rank's x in rank order; out=None gives (p * rows, 3)."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    case = f"allgather {fw_name} {dtype} {mode}"
    tensors = inputs(fw, dtype, [(2, 3)] * p, case)
    want = np.concatenate([fw.np(t) for t in tensors])
    out = None if mode == "new" else garbage(fw, dtype, (2 * p, 3), case)
    x = tensors[rank]
    if mode == "in_place":
        fw.assign(out[2 * rank:2 * rank + 2], x)
        x = out[2 * rank:2 * rank + 2]
    before = fw.np(x)
    result = fastreduce.allgather(x, out=out)
    check_gathered(checks, case, fw, dtype, mode, x, out, result, want, before)


def uneven_rows(p: int) -> list[int]:
    """Rows per rank of the uneven all-gather: 1, 2, 0, 1 (a rank with none from 3 ranks)."""
    return [(r + 1) % 3 for r in range(p)]


@pytest.mark.parametrize("mode", ["new", "out", "in_place"])
@pytest.mark.parametrize("fw_name, dtype", case_params(MOVE_CASES))
def test_allgather_uneven(fw_name, dtype, mode, checks, comm):
    """counts= (elements per rank, some 0): out=None gives (sum of rows, 3)."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    rows = uneven_rows(p)
    counts = [3 * n for n in rows]
    case = f"allgather uneven {fw_name} {dtype} {mode}"
    tensors = inputs(fw, dtype, [(n, 3) for n in rows], case)
    want = np.concatenate([fw.np(t) for t in tensors])
    out = None if mode == "new" else garbage(fw, dtype, (sum(rows), 3), case)
    x = tensors[rank]
    start = sum(rows[:rank])
    if mode == "in_place":
        fw.assign(out[start:start + rows[rank]], x)
        x = out[start:start + rows[rank]]
    before = fw.np(x)
    result = fastreduce.allgather(x, out=out, counts=tuple(counts) if mode == "out" else counts)
    check_gathered(checks, case, fw, dtype, mode, x, out, result, want, before)


# -- gather -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["new", "out", "in_place"])
@pytest.mark.parametrize("fw_name, dtype", case_params(MOVE_CASES))
def test_gather(fw_name, dtype, mode, checks, comm):
    """Every rank's x in rank order on the root (out there, None elsewhere), each root."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    for root in roots(p):
        case = f"gather {fw_name} {dtype} {mode} root={root}"
        tensors = inputs(fw, dtype, [(2, 3)] * p, case)
        want = np.concatenate([fw.np(t) for t in tensors])
        x = tensors[rank]
        out = None
        if rank == root and mode != "new":
            out = garbage(fw, dtype, (2 * p, 3), case)
            if mode == "in_place":
                fw.assign(out[2 * rank:2 * rank + 2], x)
                x = out[2 * rank:2 * rank + 2]
        before = fw.np(x)
        result = fastreduce.gather(x, root, out=out)
        if rank == root:
            check_gathered(checks, case, fw, dtype, mode, x, out, result, want, before)
        else:
            checks.check(result is None, f"{case}: a rank not the root got {result!r}")
            checks.check(same(fw.np(x), before), f"{case}: x was modified")


# -- scatter ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["new", "out", "in_place"])
@pytest.mark.parametrize("fw_name, dtype", case_params(MOVE_CASES))
def test_scatter(fw_name, dtype, mode, checks, comm):
    """Part r of the root's x into out on rank r, each root; x is None off the root, which
    gives out there; in place, out is the root's part of x (x stays as it was)."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    for root in roots(p):
        case = f"scatter {fw_name} {dtype} {mode} root={root}"
        parts = inputs(fw, dtype, [(2, 3)] * p, case)
        want = fw.np(parts[rank])
        whole = np.concatenate([fw.np(t) for t in parts])
        x = fw.make(whole, dtype) if rank == root else None
        out = None
        if rank != root or mode == "out":
            out = garbage(fw, dtype, (2, 3), case)
        elif mode == "in_place":
            out = x[2 * rank:2 * rank + 2]
        result = fastreduce.scatter(x, root, out=out)
        if rank == root and mode == "new":
            checks.check(fw.is_new(result, x, dtype, (2, 3)),
                         f"{case}: out=None gave {type(result).__name__} "
                         f"{tuple(getattr(result, 'shape', ()))}, expected a new (2, 3)")
        else:
            checks.check(result is out, f"{case}: did not return out")
        got = fw.np(result)
        checks.check(same(got, want), f"{case}: got {got.ravel()[:8]}, expected {want.ravel()[:8]}")
        if rank == root:
            checks.check(same(fw.np(x), whole), f"{case}: the root's x was modified")


# -- alltoall -----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["new", "out"])
@pytest.mark.parametrize("fw_name, dtype", case_params(MOVE_CASES))
def test_alltoall(fw_name, dtype, mode, checks, comm):
    """Equal parts: rows [2j, 2j+2) of x to rank j, from rank j into rows [2j, 2j+2)."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    case = f"alltoall {fw_name} {dtype} {mode}"
    tensors = inputs(fw, dtype, [(2 * p, 3)] * p, case)
    want = np.concatenate([fw.np(t)[2 * rank:2 * rank + 2] for t in tensors])
    x = tensors[rank]
    out = None if mode == "new" else garbage(fw, dtype, (2 * p, 3), case)
    before = fw.np(x)
    result = fastreduce.alltoall(x, out=out)
    check_gathered(checks, case, fw, dtype, mode, x, out, result, want, before)


def pair_counts(i: int, j: int) -> int:
    """Elements rank i sends to rank j in the uneven all-to-all (0 to 3)."""
    return (i + 2 * j + 1) % 4


def uneven_alltoall_case(fw: Framework, dtype: str, p: int, rank: int, case: str, f=pair_counts):
    """(this rank's x, send_counts, recv_counts, what it must receive) for counts f(i, j)."""
    tensors = inputs(fw, dtype, [(sum(f(i, j) for j in range(p)),) for i in range(p)], case)
    send = [f(rank, j) for j in range(p)]
    recv = [f(j, rank) for j in range(p)]
    pieces = []
    for j, t in enumerate(tensors):
        start = sum(f(j, k) for k in range(rank))
        pieces.append(fw.np(t)[start:start + f(j, rank)])
    return tensors[rank], send, recv, np.concatenate(pieces)


@pytest.mark.parametrize("mode", ["new", "out"])
@pytest.mark.parametrize("fw_name, dtype", case_params(MOVE_CASES))
def test_alltoall_uneven(fw_name, dtype, mode, checks, comm):
    """send_counts and recv_counts (elements per rank, some 0)."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    case = f"alltoall uneven {fw_name} {dtype} {mode}"
    x, send, recv, want = uneven_alltoall_case(fw, dtype, p, rank, case)
    out = None if mode == "new" else garbage(fw, dtype, (sum(recv),), case)
    before = fw.np(x)
    result = fastreduce.alltoall(x, out=out, send_counts=send, recv_counts=recv)
    check_gathered(checks, case, fw, dtype, mode, x, out, result, want, before)


# -- reduce_ and reduce_scatter -----------------------------------------------------------

def reduction_inputs(fw: Framework, dtype: str, op: str, shape: tuple, p: int, case: str):
    """Every rank's input of a reduction (integral values: sums and products exact) and
    their widened stack."""
    tensors = [fw.make(values(dtype, op, shape, r, case, True), dtype) for r in range(p)]
    return tensors, np.stack([fw.wide(t) for t in tensors])


@pytest.mark.parametrize("fw_name, dtype", case_params(REDUCE_CASES))
def test_reduce(fw_name, dtype, checks, comm):
    """sum, avg, max and prod into x on the root, each root; x is only read elsewhere."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    for op in ops_of(dtype):
        for root in roots(p):
            for shape in [(3, 5), (0,)]:
                case = f"reduce_ {fw_name} {dtype} {op} root={root} {shape}"
                tensors, stack = reduction_inputs(fw, dtype, op, shape, p, case)
                x = tensors[rank]
                before = fw.np(x)
                result = fastreduce.reduce_(x, op, root)
                checks.check(result is x, f"{case}: reduce_ did not return x")
                if rank == root:
                    want = reduce(stack, op, p)
                    checks.check(matches(fw.wide(x), want, dtype, op, stack, p),
                                 f"{case}: got {fw.np(x).ravel()[:6]}, expected "
                                 f"{want.ravel()[:6]}")
                else:
                    checks.check(same(fw.np(x), before), f"{case}: x changed off the root")


def reduce_scatter_counts(p: int) -> list[int]:
    return [3, 0, 5, 2][:p]


@pytest.mark.parametrize("mode", ["new", "out"])
@pytest.mark.parametrize("fw_name, dtype", case_params(REDUCE_CASES))
def test_reduce_scatter(fw_name, dtype, mode, checks, comm):
    """sum, avg, max and prod: part r of the reduction on rank r, in equal parts (x of
    (2p, 3): out=None gives (2, 3)) and uneven counts= (some 0)."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    for op in ops_of(dtype):
        for counts in [None, reduce_scatter_counts(p)]:
            case = f"reduce_scatter {fw_name} {dtype} {op} {mode} counts={counts}"
            shape = (2 * p, 3) if counts is None else (sum(counts),)
            tensors, stack = reduction_inputs(fw, dtype, op, shape, p, case)
            sizes = [6] * p if counts is None else counts
            start = sum(sizes[:rank])
            full = reduce(stack, op, p).reshape(-1)
            want = full[start:start + sizes[rank]]
            part = stack.reshape(p, -1)[:, start:start + sizes[rank]]
            want_shape = (2, 3) if counts is None else (sizes[rank],)
            x = tensors[rank]
            before = fw.np(x)
            out = None if mode == "new" else garbage(fw, dtype, want_shape, case)
            result = fastreduce.reduce_scatter(x, op, out=out, counts=counts)
            if mode == "new":
                checks.check(fw.is_new(result, x, dtype, want_shape),
                             f"{case}: out=None gave {type(result).__name__} "
                             f"{tuple(getattr(result, 'shape', ()))}, expected {want_shape}")
            else:
                checks.check(result is out, f"{case}: did not return out")
            checks.check(matches(fw.wide(result).reshape(-1), want, dtype, op, part, p),
                         f"{case}: got {fw.np(result).ravel()[:6]}, expected {want[:6]}")
            checks.check(same(fw.np(x), before), f"{case}: x was modified")


# -- send and recv ------------------------------------------------------------------------

@pytest.mark.mpi(ranks=(2, 3, 4))  # a blocking send to itself is not safe on one rank
@pytest.mark.parametrize("fw_name, dtype", case_params(MOVE_CASES))
def test_send_recv_ring(fw_name, dtype, checks, comm):
    """Rank r sends to r + 1 with tag 10 + r and receives from r - 1 (odd ranks naming the
    tag, even ones any tag); recv returns (source, tag). Even ranks send first, odd ranks
    receive first."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    for shape in [(4, 3), (0,)]:
        case = f"send/recv {fw_name} {dtype} {shape}"
        tensors = inputs(fw, dtype, [shape] * p, case)
        x = tensors[rank]
        before = fw.np(x)
        dest, source = (rank + 1) % p, (rank - 1) % p
        box = garbage(fw, dtype, shape, case)
        got = None
        if rank % 2:
            got = fastreduce.recv(box, source, 10 + source)
        checks.check(fastreduce.send(x, dest, 10 + rank) is None, f"{case}: send returned")
        if rank % 2 == 0:  # the source named, any tag: recv says which
            got = fastreduce.recv(box, source)
        checks.check(got == (source, 10 + source), f"{case}: recv returned {got}")
        checks.check(same(fw.np(box), fw.np(tensors[source])), f"{case}: received {fw.np(box)}")
        checks.check(same(fw.np(x), before), f"{case}: send modified x")


@pytest.mark.mpi(ranks=(2, 3, 4))
@pytest.mark.parametrize("fw_name, dtype", case_params([("torch", "float64"), ("numpy", "int64")]))
def test_recv_any_source(fw_name, dtype, checks, comm):
    """Rank 0 receives from any rank with any tag (recv says which), then from any rank
    by tag in the order it picks; the others send to 0 with tags 100 + r and 200 + r."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    case = f"any source {fw_name} {dtype}"
    tensors = inputs(fw, dtype, [(5,)] * p, case)
    if rank == 0:
        seen = set()
        for _ in range(p - 1):
            box = garbage(fw, dtype, (5,), case)
            source, tag = fastreduce.recv(box)
            seen.add((source, tag))
            checks.check(0 < source < p and same(fw.np(box), fw.np(tensors[source])),
                         f"{case}: from {source} received {fw.np(box)}")
        checks.check(seen == {(r, 100 + r) for r in range(1, p)}, f"{case}: saw {sorted(seen)}")
        comm.Barrier()  # the second messages are sent after it: any source, any tag took the first
        for r in reversed(range(1, p)):  # by tag, any source: the sender is the tag's
            box = garbage(fw, dtype, (5,), case)
            got = fastreduce.recv(box, None, 200 + r)
            checks.check(got == (r, 200 + r), f"{case}: recv by tag {200 + r} returned {got}")
            checks.check(same(fw.np(box), fw.np(tensors[r])), f"{case}: tag {200 + r} gave "
                                                               f"{fw.np(box)}")
    else:
        fastreduce.send(tensors[rank], 0, 100 + rank)
        comm.Barrier()
        fastreduce.send(tensors[rank], 0, tag=200 + rank)


@pytest.mark.mpi(ranks=(2, 3))
def test_a_dropped_point_to_point_request_is_abandoned(checks, comm):
    """An irecv whose message never comes, dropped, is cancelled (garbage collection does
    not wait for ever); an isend dropped before its receive keeps its memory and is still
    received whole; a later exchange on the same tag is not disturbed."""
    import gc

    rank, p = comm.rank, comm.size
    right, left = (rank + 1) % p, (rank - 1) % p
    request = fastreduce.irecv(np.zeros(4), left, 91)  # nobody sends on tag 91
    del request
    gc.collect()
    sent = np.arange(4.0) + 10 * rank
    request = fastreduce.isend(sent.copy(), right, 92)
    del request  # dropped: its memory stays, the message still goes
    gc.collect()
    box = np.zeros(4)
    fastreduce.recv(box, left, 92)
    checks.check(np.array_equal(box, np.arange(4.0) + 10 * left), f"tag 92 gave {box}")
    box = np.zeros(4)
    received = fastreduce.irecv(box, left, 91)
    fastreduce.isend(sent, right, 91).wait()
    received.wait()
    checks.check(np.array_equal(box, sent - 10 * rank + 10 * left), f"tag 91 gave {box}")
    comm.Barrier()


# -- empty tensors ------------------------------------------------------------------------

@pytest.mark.parametrize("fw_name", ["torch", "numpy"])
def test_empty_tensors(fw_name, checks, comm):
    """Every call on tensors of no elements: nothing to move, the right empty results (and
    a 0-d tensor's all-gather: one row per rank)."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    dtype = "float32"
    empty = fw.make(np.zeros((0, 3)), dtype)
    checks.check(fastreduce.broadcast_(empty, p - 1) is empty, "broadcast_")
    checks.check(fastreduce.reduce_(empty, "max", p - 1) is empty, "reduce_")
    for result, name, shape in [
        (fastreduce.allgather(empty), "allgather", (0, 3)),
        (fastreduce.allgather(empty, counts=[0] * p), "allgather counts", (0, 3)),
        (fastreduce.alltoall(empty), "alltoall", (0, 3)),
        (fastreduce.alltoall(empty, send_counts=[0] * p, recv_counts=[0] * p),
         "alltoall counts", (0, 3)),
        (fastreduce.reduce_scatter(empty), "reduce_scatter", (0, 3)),
        (fastreduce.reduce_scatter(empty, "avg", counts=[0] * p), "reduce_scatter counts",
         (0, 3)),
    ]:
        checks.check(fw.is_new(result, empty, dtype, shape),
                     f"{name}: {type(result).__name__} {tuple(result.shape)}, expected {shape}")
    scalar = fw.make(np.array(float(rank)), dtype)
    got = fastreduce.allgather(scalar)
    checks.check(fw.is_new(got, scalar, dtype, (p,))
                 and same(fw.np(got), np.arange(p, dtype=dtype)),
                 f"allgather of a 0-d tensor: {got}")
    gathered = fastreduce.gather(empty, p - 1)
    checks.check(gathered is None if rank != p - 1 else
                 fw.is_new(gathered, empty, dtype, (0, 3)), f"gather gave {gathered!r}")
    out = fw.make(np.zeros((0, 3)), dtype)
    scattered = fastreduce.scatter(empty if rank == 0 else None, 0, out=out)
    checks.check(scattered is out, "scatter did not return out")
    # an uneven all-to-all in which some ranks send nothing: here, every rank but the last
    # sends one element to each rank, the last sends none
    x, send, recv, want = uneven_alltoall_case(
        fw, dtype, p, rank, "empty alltoall", lambda i, j: int(i != p - 1))
    got = fw.np(fastreduce.alltoall(x, send_counts=send, recv_counts=recv))
    checks.check(same(got, want), f"alltoall with empty sends: {got}, expected {want}")
    if p > 1:
        box = fw.make(np.zeros(0), dtype)
        if rank == 0:
            got = [fastreduce.recv(box) for _ in range(p - 1)]
            checks.check(sorted(got) == [(r, 7) for r in range(1, p)], f"recv gave {got}")
        else:
            fastreduce.send(box, 0, 7)


# -- communicators ------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["none", "world", "split"])
def test_communicators(which, checks, comm):
    """comm=None (the default communicator), COMM_WORLD, and a subcommunicator of the
    ranks of one parity in reverse order (its ranks are not the world's): every call."""
    fw, dtype = framework("torch"), "float64"
    world = comm.rank
    sub = comm.Split(world % 2, -world) if which == "split" else None
    use = None if which == "none" else sub if which == "split" else comm
    members = sorted((r for r in range(comm.size) if r % 2 == world % 2), reverse=True) \
        if which == "split" else list(range(comm.size))
    p, rank = len(members), members.index(world)
    case = f"comm={which}"

    def each(shape, tag):  # every member's input, seeded by its world rank
        return [fw.make(raw(dtype, shape, r, f"{case} {tag}"), dtype) for r in members]

    t = each((4,), "bcast")
    want = fw.np(t[p - 1])
    fastreduce.broadcast_(t[rank], p - 1, comm=use)
    checks.check(same(fw.np(t[rank]), want), f"{case}: broadcast_ from the last member")

    t = each((2, 2), "allgather")
    got = fw.np(fastreduce.allgather(t[rank], comm=use))
    checks.check(same(got, np.concatenate([fw.np(a) for a in t])), f"{case}: allgather {got}")

    t = each((2 * p,), "alltoall")
    got = fw.np(fastreduce.alltoall(t[rank], comm=use))
    checks.check(same(got, np.concatenate([fw.np(a)[2 * rank:2 * rank + 2] for a in t])),
                 f"{case}: alltoall {got}")

    t = each((3,), "gather")
    got = fastreduce.gather(t[rank], p - 1, comm=use)
    want = np.concatenate([fw.np(a) for a in t])
    checks.check(same(fw.np(got), want) if rank == p - 1 else got is None,
                 f"{case}: gather gave {got}")

    t = each((3,), "scatter")
    whole = np.concatenate([fw.np(a) for a in t])
    got = fastreduce.scatter(fw.make(whole, dtype) if rank == 0 else None, 0, comm=use,
                             out=None if rank == 0 else garbage(fw, dtype, (3,), case))
    checks.check(same(fw.np(got), fw.np(t[rank])), f"{case}: scatter gave {got}")

    ints = [fw.make(values(dtype, "sum", (2 * p,), r, case, True), dtype) for r in members]
    stack = np.stack([fw.np(a) for a in ints])
    got = fw.np(fastreduce.reduce_scatter(ints[rank], comm=use))
    checks.check(same(got, stack.sum(0)[2 * rank:2 * rank + 2]), f"{case}: reduce_scatter {got}")
    x = ints[rank]
    fastreduce.reduce_(x, "max", p - 1, comm=use)
    if rank == p - 1:
        checks.check(same(fw.np(x), stack.max(0)), f"{case}: reduce_ max {fw.np(x)}")

    if p > 1:  # the last member sends to the first, by their ranks in this communicator
        t = each((3,), "p2p")
        if rank == p - 1:
            fastreduce.send(t[rank], 0, 5, comm=use)
        elif rank == 0:
            box = garbage(fw, dtype, (3,), case)
            got = fastreduce.recv(box, comm=use)
            checks.check(got == (p - 1, 5) and same(fw.np(box), fw.np(t[p - 1])),
                         f"{case}: recv returned {got}, {fw.np(box)}")
    if sub is not None:
        sub.Free()


def test_mpi_ops_and_read_only_inputs(checks, comm):
    """mpi4py's Op objects as reduce_'s and reduce_scatter's op; read-only arrays where a
    call only reads them: the root's x of broadcast_, x of reduce_ off the root, of
    allgather, gather, alltoall, reduce_scatter and send."""
    p, rank = comm.size, comm.rank

    def ro(a):
        a = np.array(a)
        a.flags.writeable = False
        return a

    x = np.arange(4.0) * (rank + 1)
    fastreduce.reduce_(x, MPI.MAX, p - 1)
    want = np.arange(4.0) * (p if rank == p - 1 else rank + 1)
    checks.check(same(x, want), f"reduce_ with MPI.MAX: {x}")
    got = fastreduce.reduce_scatter(np.arange(2.0 * p) + rank, MPI.SUM)
    want = (np.arange(2.0 * p) * p + sum(range(p)))[2 * rank:2 * rank + 2]
    checks.check(same(got, want), f"reduce_scatter with MPI.SUM: {got}")

    mine = np.arange(3.0) + 10 * rank
    x = ro(mine) if rank == p - 1 else np.zeros(3)
    fastreduce.broadcast_(x, p - 1)
    checks.check(same(x, np.arange(3.0) + 10 * (p - 1)), f"broadcast_ from a read-only x: {x}")
    x = ro(mine) if rank != 0 else mine.copy()
    fastreduce.reduce_(x, "sum", 0)
    want = np.arange(3.0) * p + 10 * sum(range(p)) if rank == 0 else mine
    checks.check(same(x, want), f"reduce_ with read-only x off the root: {x}")
    everyone = np.concatenate([np.arange(3.0) + 10 * r for r in range(p)])
    checks.check(same(fastreduce.allgather(ro(mine)), everyone), "allgather of a read-only x")
    got = fastreduce.gather(ro(mine), 0)
    checks.check(same(got, everyone) if rank == 0 else got is None, "gather of a read-only x")
    got = fastreduce.alltoall(ro(np.full(2 * p, float(rank))))
    checks.check(same(got, np.repeat(np.arange(float(p)), 2)), f"alltoall of a read-only x: {got}")
    got = fastreduce.reduce_scatter(ro(np.ones(2 * p)), "sum")
    checks.check(same(got, np.full(2, float(p))), f"reduce_scatter of a read-only x: {got}")
    got = fastreduce.scatter(ro(everyone) if rank == 0 else None, 0,
                             out=None if rank == 0 else np.zeros(3))
    checks.check(same(got, mine), f"scatter of a read-only x: {got}")
    if p > 1:
        if rank == 1:
            fastreduce.send(ro(mine), 0)
        elif rank == 0:
            box = np.zeros(3)
            fastreduce.recv(box, 1)
            checks.check(same(box, np.arange(3.0) + 10), f"send of a read-only x: {box}")


def test_torch_lazy_views(checks, comm):
    """torch's conjugate views (memory holding the conjugates) as what a call writes: x of
    broadcast_ and of reduce_ on the root, allgather's out and x, recv's x; the values seen
    through the views are the right ones."""
    p, rank = comm.size, comm.rank

    def value(r, n=3):
        return torch.arange(float(n)).to(torch.complex64) + 1j * (r + 1)

    x = value(rank).conj()
    fastreduce.broadcast_(x, p - 1)
    checks.check(torch.equal(x.resolve_conj(), value(p - 1).conj()),
                 f"broadcast_ into a conj view: {x}")
    x = value(rank).conj()
    fastreduce.reduce_(x, "sum", p - 1)
    want = sum(value(r) for r in range(p)).conj() if rank == p - 1 else value(rank).conj()
    checks.check(torch.equal(x.resolve_conj(), want), f"reduce_ into a conj view: {x}")
    out = torch.zeros(3 * p, dtype=torch.complex64).conj()
    fastreduce.allgather(value(rank), out=out)
    checks.check(torch.equal(out.resolve_conj(), torch.cat([value(r) for r in range(p)])),
                 f"allgather into a conj view: {out}")
    got = fastreduce.allgather(value(rank).conj())
    checks.check(torch.equal(got.resolve_conj(), torch.cat([value(r).conj() for r in range(p)])),
                 f"allgather of a conj view: {got}")
    if p > 1:
        if rank == 1:
            fastreduce.send(value(1), 0)
        elif rank == 0:
            box = torch.zeros(3, dtype=torch.complex64).conj()
            fastreduce.recv(box, 1)
            checks.check(torch.equal(box.resolve_conj(), value(1)), f"recv into a conj view: {box}")


# -- counts past the int limit ------------------------------------------------------------

LIMIT = 8
LIMITED = pytest.mark.parametrize("count_limit", [pytest.param(LIMIT, id=f"limit{LIMIT}")],
                                  indirect=True)
LIMIT_CASES = case_params([("numpy", "float64"), ("torch", "bfloat16"), ("torch", "int8")])


@LIMITED
@pytest.mark.parametrize("fw_name, dtype", LIMIT_CASES)
def test_pieces_past_the_limit(fw_name, dtype, count_limit, checks, comm):
    """broadcast_ (bytes) and reduce_ (elements) past the limit go in pieces of it."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    for n in [13, 2 * count_limit, 3 * count_limit + 1]:
        case = f"broadcast_ {fw_name} {dtype} {n} limit={count_limit}"
        tensors = inputs(fw, dtype, [(n,)] * p, case)
        want = fw.np(tensors[p - 1])
        fastreduce.broadcast_(tensors[rank], p - 1)
        checks.check(same(fw.np(tensors[rank]), want), f"{case}: got {fw.np(tensors[rank])}")
        for op in ["sum", "max"] + (["avg"] if dtype in FLOATS else []):
            case = f"reduce_ {fw_name} {dtype} {op} {n} limit={count_limit}"
            tensors, stack = reduction_inputs(fw, dtype, op, (n,), p, case)
            x = tensors[rank]
            before = fw.np(x)
            fastreduce.reduce_(x, op, p - 1)
            if rank == p - 1:
                want = reduce(stack, op, p)
                checks.check(matches(fw.wide(x), want, dtype, op, stack, p),
                             f"{case}: got {fw.np(x)}, expected {want}")
            else:
                checks.check(same(fw.np(x), before), f"{case}: x changed off the root")


@LIMITED
@pytest.mark.parametrize("fw_name, dtype", LIMIT_CASES)
def test_element_types_under_the_limit(fw_name, dtype, count_limit, checks, comm):
    """More bytes than the limit but no more elements: allgather (equal, uneven, in
    place), alltoall (equal, uneven), gather and scatter count in elements."""
    fw, p, rank = framework(fw_name), comm.size, comm.rank
    case = f"element types {fw_name} {dtype}"
    tensors = inputs(fw, dtype, [(2,)] * p, case)  # 2p <= 8 elements in all
    want = np.concatenate([fw.np(t) for t in tensors])
    got = fw.np(fastreduce.allgather(tensors[rank]))
    checks.check(same(got, want), f"{case}: allgather {got}, expected {want}")
    out = garbage(fw, dtype, (2 * p,), case)
    fw.assign(out[2 * rank:2 * rank + 2], tensors[rank])
    fastreduce.allgather(out[2 * rank:2 * rank + 2], out=out)
    checks.check(same(fw.np(out), want), f"{case}: allgather in place {fw.np(out)}")
    got = fastreduce.gather(tensors[rank], p - 1)
    checks.check(same(fw.np(got), want) if rank == p - 1 else got is None,
                 f"{case}: gather {got}")
    got = fw.np(fastreduce.scatter(fw.make(want, dtype) if rank == 0 else None, 0,
                                   out=None if rank == 0 else garbage(fw, dtype, (2,), case)))
    checks.check(same(got, fw.np(tensors[rank])), f"{case}: scatter {got}")

    counts = [1, 2, 0, 3][:p]
    uneven = inputs(fw, dtype, [(c,) for c in counts], case + " uneven")
    got = fw.np(fastreduce.allgather(uneven[rank], counts=counts))
    want = np.concatenate([fw.np(t) for t in uneven])
    checks.check(same(got, want), f"{case}: allgather uneven {got}, expected {want}")

    wide = inputs(fw, dtype, [(2 * p,)] * p, case + " alltoall")
    got = fw.np(fastreduce.alltoall(wide[rank]))
    want = np.concatenate([fw.np(t)[2 * rank:2 * rank + 2] for t in wide])
    checks.check(same(got, want), f"{case}: alltoall {got}, expected {want}")
    x, send, recv, want = uneven_alltoall_case(fw, dtype, p, rank, case + " alltoallv",
                                               lambda i, j: (i + j) % 2 + 1)
    got = fw.np(fastreduce.alltoall(x, send_counts=send, recv_counts=recv))
    checks.check(same(got, want), f"{case}: alltoall uneven {got}, expected {want}")

    def one_to_first(i, j):  # the last rank moves one element (bytes under the limit), with
        last = {i, j} == {0, p - 1} or i == j == p - 1 == 0  # rank 0; the others two each
        return 1 if last else 0 if p - 1 in (i, j) else 2

    x, send, recv, want = uneven_alltoall_case(fw, dtype, p, rank, case + " mixed", one_to_first)
    got = fw.np(fastreduce.alltoall(x, send_counts=send, recv_counts=recv))
    checks.check(same(got, want), f"{case}: alltoall, bytes on one rank: {got}, expected {want}")

    if p > 1:  # send and recv of 4 elements (more bytes than the limit)
        four = inputs(fw, dtype, [(4,)] * p, case + " p2p")
        box = garbage(fw, dtype, (4,), case)
        if rank == 0:
            got = [fastreduce.recv(box, r, 3) for r in range(1, p)]
            checks.check(got[-1] == (p - 1, 3) and same(fw.np(box), fw.np(four[p - 1])),
                         f"{case}: recv {got}, {fw.np(box)}")
        else:
            fastreduce.send(four[rank], 0, 3)


def refused_everywhere(checks, comm, exc_type, words, fn, *unchanged) -> list:
    """fn() raises exc_type with `words` on this rank, leaving `unchanged` as they were;
    returns what every rank's call did ("refused", "returned" or another exception)."""
    before = [np.array(np.asarray(u)) if not isinstance(u, torch.Tensor) else u.clone()
              for u in unchanged]
    try:
        fn()
    except exc_type as exc:
        outcome = "refused"
        missing = [w for w in words if w not in str(exc)]
        checks.check(not missing, f"message {str(exc)!r} lacks {missing}")
    except Exception as exc:  # noqa: BLE001
        outcome = repr(exc)
    else:
        outcome = "returned"
    for b, u in zip(before, unchanged, strict=True):
        checks.check(np.array_equal(np.asarray(b), np.asarray(u)),
                     f"a call refused with {exc_type.__name__} modified its tensors")
    everyone = comm.allgather(outcome)
    checks.check(all(o == "refused" for o in everyone),
                 f"expected {exc_type.__name__} ({words}) on every rank; the ranks did "
                 f"{everyone}")
    return everyone


@LIMITED
def test_past_the_limit_refused_everywhere(count_limit, checks, comm):
    """More elements than the limit in one call: allgather, equal all-to-all and
    reduce_scatter (equal parts, and uneven counts with one rank's part past it) raise
    OverflowError on every rank, naming the fix, before any MPI call; reduce_scatter under
    it works."""
    p, rank = comm.size, comm.rank
    n = count_limit + 1
    x = np.arange(n, dtype=np.float64) + rank
    out = np.full(n * p, -1.0)
    refused_everywhere(checks, comm, OverflowError, ["allgather", "split the tensor"],
                       lambda: fastreduce.allgather(x, out=out), x, out)
    refused_everywhere(checks, comm, OverflowError, ["allgather"],
                       lambda: fastreduce.allgather(x, counts=[n] * p), x)
    big = np.arange(n * p, dtype=np.float64)
    refused_everywhere(checks, comm, OverflowError, ["alltoall"],
                       lambda: fastreduce.alltoall(big), big)
    refused_everywhere(checks, comm, OverflowError, ["reduce_scatter", "split the tensor"],
                       lambda: fastreduce.reduce_scatter(big), big)
    counts = [1] * (p - 1) + [n]  # only the last rank's part is past the limit
    y = np.ones(sum(counts), dtype=np.float32)
    mine = np.full(counts[rank], -1.0, dtype=np.float32)
    refused_everywhere(checks, comm, OverflowError, ["reduce_scatter"],
                       lambda: fastreduce.reduce_scatter(y, out=mine, counts=counts), y, mine)
    got = fastreduce.reduce_scatter(np.ones(2 * p), counts=[2] * p)
    checks.check(same(got, np.full(2, float(p))), f"reduce_scatter under the limit: {got}")


@pytest.mark.mpi(ranks=(2, 3, 4))
@LIMITED
def test_uneven_alltoall_past_the_limit_on_one_rank(count_limit, checks, comm):
    """An uneven all-to-all in which only rank 0 moves more elements than the limit (it
    sends limit + 1 to itself, one to each other rank; every other rank one to each): no
    rank may refuse alone, leaving the others in MPI_Alltoallv. Every rank must raise
    OverflowError, or every rank give the right result. A rank that refused completes the
    all-to-all with mpi4py so that the others, if they are in it, return."""
    p, rank = comm.size, comm.rank
    dup = comm.Dup()

    def f(i, j):
        return count_limit + 1 if i == j == 0 else 1

    x, send, recv, want = uneven_alltoall_case(framework("numpy"), "float64", p, rank,
                                               "alltoall one rank past the limit", f)
    out = np.full(sum(recv), -1.0)
    try:
        fastreduce.alltoall(x, comm=dup, out=out, send_counts=send, recv_counts=recv)
        outcome = "returned"
    except OverflowError:
        outcome = "refused"
        scratch = np.empty_like(out)
        sent, got = [8 * c for c in send], [8 * c for c in recv]  # bytes, as fastreduce's
        dup.Alltoallv([x, (sent, [sum(sent[:j]) for j in range(p)]), MPI.BYTE],
                      [scratch, (got, [sum(got[:j]) for j in range(p)]), MPI.BYTE])
    everyone = comm.allgather(outcome)
    dup.Free()
    checks.check(len(set(everyone)) == 1,
                 f"rank(s) {[r for r, o in enumerate(everyone) if o == 'refused']} raised "
                 f"OverflowError and the others went into MPI_Alltoallv (they hang there "
                 f"in a program; here the refusing ranks completed the call): {everyone}")
    if outcome == "returned":
        checks.check(same(out, want), f"alltoall gave {out}, expected {want}")


# -- bad input ----------------------------------------------------------------------------

@pytest.fixture
def flight_record():
    """The flight record on (a timeout set, far beyond the case's), so that a refused
    call can be seen to have made no MPI call; the earlier setting restored after."""
    old = fastreduce.watchdog.timeout()
    fastreduce.set_timeout(3600)
    yield
    fastreduce.set_timeout(old)


class Refusals:
    """checks.expect, and nothing in the flight record: no MPI call was made."""

    def __init__(self, checks) -> None:
        self.checks = checks

    def expect(self, exc_type, words, fn, *unchanged) -> None:
        before = fastreduce.flight_record()
        last = before[-1]["number"] if before else None
        self.checks.expect(exc_type, words, fn, *unchanged)
        after = fastreduce.flight_record()
        made = [e["call"] for e in after if last is None or e["number"] > last]
        self.checks.check(not made, f"a call refused with {exc_type.__name__} ({words}) made "
                                    f"MPI calls: {made}")


@pytest.fixture
def refusals(checks, flight_record):
    calls = fastreduce.flight_record()
    fastreduce.allgather(np.zeros(1))  # the record works: this call is in it
    checks.check(len(fastreduce.flight_record()) > len(calls) or len(calls) == 64,
                 "the flight record did not record an allgather")
    return Refusals(checks)


def test_bad_ranks(refusals, comm):
    """A root, dest or source out of range (ValueError) or not an int (TypeError)."""
    p = comm.size
    x = np.arange(4.0)
    t = torch.arange(4.0)
    calls = [("root", lambda b: fastreduce.broadcast_(x, b), [x]),
             ("root", lambda b: fastreduce.reduce_(t, root=b), [t]),
             ("root", lambda b: fastreduce.gather(x, b), [x]),
             ("root", lambda b: fastreduce.scatter(x, b, out=t), [x, t]),
             ("dest", lambda b: fastreduce.send(t, b), [t]),
             ("source", lambda b: fastreduce.recv(x, b), [x])]
    for what, call, unchanged in calls:
        for bad in (p, -1):
            refusals.expect(ValueError, [f"{what} {bad} is not a rank", f"0..{p - 1}"],
                            lambda c=call, b=bad: c(b), *unchanged)
        for bad in ("0", 0.0, True, np.zeros(1)):
            refusals.expect(TypeError, [f"{what} must be an int rank"],
                            lambda c=call, b=bad: c(b), *unchanged)
    refusals.expect(TypeError, ["dest must be an int rank"], lambda: fastreduce.send(t, None), t)


def test_bad_tags(refusals):
    """A negative tag, one that is not an int, or one past MPI_TAG_UB: send's, and recv's
    with or without a source."""
    x = np.arange(3.0)
    for bad in (-1, "1", 1.5):
        for call in (lambda b: fastreduce.send(x, 0, b), lambda b: fastreduce.recv(x, 0, b),
                     lambda b: fastreduce.recv(x, None, b)):
            refusals.expect(ValueError, ["tag must be a non-negative int"],
                            lambda c=call, b=bad: c(b), x)
    past = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) + 1  # Open MPI: an OverflowError; MPICH: MPI's
    for call in (lambda: fastreduce.send(x, 0, past), lambda: fastreduce.recv(x, 0, past),
                 lambda: fastreduce.isend(x, 0, past), lambda: fastreduce.irecv(x, 0, past)):
        refusals.expect(ValueError, ["past the largest this MPI takes", "MPI_TAG_UB"], call, x)


def test_read_only_receive_buffer(refusals):
    """recv into a read-only array."""
    ro = np.zeros(3)
    ro.flags.writeable = False
    refusals.expect(BufferError, ["x is read-only"], lambda: fastreduce.recv(ro, 0), ro)
    refusals.expect(BufferError, ["x is read-only"], lambda: fastreduce.recv(ro), ro)


def bad_outs(n: int) -> list:
    """(exception, words, out, what to keep unchanged) for an out that must hold n float64
    elements: of float32, of n + 1 elements, in CUDA pinned memory (another device), and
    read-only."""
    pinned = np.zeros(n)
    read_only = np.zeros(n)
    read_only.flags.writeable = False
    wrong_dtype, wrong_size = np.zeros(n, np.float32), np.zeros(n + 1)
    return [(ValueError, ["out is float32", "float64"], wrong_dtype, wrong_dtype),
            (ValueError, [f"out has {n + 1} elements", f"needs {n}"], wrong_size, wrong_size),
            (ValueError, ["out is on cpu (CUDA pinned)", "the input on cpu"],
             FakeTensor(pinned, device=(3, 0)), pinned),
            (BufferError, ["out is read-only"], read_only, read_only)]


def test_bad_out(refusals, comm):
    """out of the wrong dtype, size or device, or read-only: allgather, reduce_scatter,
    alltoall (equal and uneven), gather and scatter on the root (the other ranks refuse
    too: gather's because they give out, scatter's because they do not); torch's outs of
    another dtype or size."""
    p, rank = comm.size, comm.rank
    x = np.arange(2.0 * p) + rank
    for exc, words, out, kept in bad_outs(2 * p * p):
        refusals.expect(exc, words, lambda o=out: fastreduce.allgather(x, out=o), x, kept)
        refusals.expect(exc, words, lambda o=out: fastreduce.allgather(
            x, out=o, counts=[2 * p] * p), x, kept)
        if rank == p - 1:
            refusals.expect(exc, words, lambda o=out: fastreduce.gather(x, p - 1, out=o),
                            x, kept)
        else:
            refusals.expect(ValueError, ["not the root", "out=None"],
                            lambda o=out: fastreduce.gather(x, p - 1, out=o), x, kept)
    whole = np.arange(2.0 * p * p)  # scatter: the root's x, 2p elements for each rank
    for exc, words, out, kept in bad_outs(2 * p):
        refusals.expect(exc, words, lambda o=out: fastreduce.alltoall(x, out=o), x, kept)
        refusals.expect(exc, words, lambda o=out: fastreduce.alltoall(
            x, out=o, send_counts=[2] * p, recv_counts=[2] * p), x, kept)
        if rank == 0:
            refusals.expect(exc, words, lambda o=out: fastreduce.scatter(whole, 0, out=o),
                            whole, kept)
        else:
            refusals.expect(TypeError, ["needs out="], lambda: fastreduce.scatter(None, 0))
    for exc, words, out, kept in bad_outs(2):
        refusals.expect(exc, words, lambda o=out: fastreduce.reduce_scatter(x, out=o), x, kept)
        refusals.expect(exc, words, lambda o=out: fastreduce.reduce_scatter(
            x, "max", out=o, counts=[2] * p), x, kept)
    t = torch.arange(2.0 * p) + rank
    wide = torch.zeros(2 * p * p, dtype=torch.float64)
    refusals.expect(ValueError, ["out is float64", "float32"],
                    lambda: fastreduce.allgather(t, out=wide), t, wide)
    three = torch.zeros(3)
    refusals.expect(ValueError, ["out has 3 elements", "needs 2"],
                    lambda: fastreduce.reduce_scatter(t, out=three), t, three)


def test_scatter_refusals(refusals, comm):
    """scatter: x None on the root (TypeError); the root's x that does not divide among the
    ranks; no out on a rank not the root (TypeError); out read-only everywhere."""
    p, rank = comm.size, comm.rank
    refusals.expect(TypeError, ["x is None on the root"] if rank == 0 else ["needs out="],
                    lambda: fastreduce.scatter(None, 0))
    odd = np.arange(2.0 * p + 1)
    if p > 1:
        refusals.expect(ValueError if rank == 0 else TypeError,
                        ["do not divide among"] if rank == 0 else ["needs out="],
                        lambda: fastreduce.scatter(odd if rank == 0 else None, 0), odd)
    ro = np.zeros(2)
    ro.flags.writeable = False
    whole = np.arange(2.0 * p)
    refusals.expect(BufferError, ["out is read-only"], lambda: fastreduce.scatter(
        whole if rank == 0 else None, 0, out=ro), whole, ro)


def test_gather_refusals(refusals, comm):
    """gather: out given on a rank that is not the root (the root refuses its out of the
    wrong size); out overlapping x elsewhere than x's slot on the root."""
    p, rank = comm.size, comm.rank
    root = p - 1
    x = np.arange(3.0) + rank
    out = np.full(3 * p + 2, -1.0)
    refusals.expect(ValueError, ["out has"] if rank == root else ["not the root", "out=None"],
                    lambda: fastreduce.gather(x, root, out=out), x, out)
    buf = np.arange(3.0 * p + 1)
    shifted = buf[3 * rank + 1:3 * rank + 4]  # one element past this rank's slot
    refusals.expect(ValueError, ["overlaps"] if rank == root else ["not the root"],
                    lambda: fastreduce.gather(shifted, root, out=buf[:3 * p]), buf)


def test_not_contiguous(refusals, comm):
    """A non-contiguous x (or out) is refused by every call."""
    p, rank = comm.size, comm.rank
    t = torch.arange(4.0 * p * 2).reshape(2 * p, 4)
    a = np.arange(4.0 * p * 2).reshape(2 * p, 4)
    calls = [lambda v: fastreduce.broadcast_(v),
             lambda v: fastreduce.reduce_(v, "sum", p - 1),
             lambda v: fastreduce.allgather(v),
             lambda v: fastreduce.reduce_scatter(v),
             lambda v: fastreduce.alltoall(v),
             lambda v: fastreduce.gather(v, p - 1),
             lambda v: fastreduce.send(v, 0),
             lambda v: fastreduce.recv(v, 0),
             # scatter: the root's x, the others' out
             lambda v: fastreduce.scatter(v if rank == 0 else None, 0,
                                          out=None if rank == 0 else v)]
    for x in (t[:, ::2], a[:, ::2], t.T):
        for call in calls:
            refusals.expect(BufferError, ["not contiguous"], lambda c=call, v=x: c(v), x)
    out = torch.zeros(2 * p * 2, 2)
    refusals.expect(BufferError, ["out is not contiguous"],
                    lambda: fastreduce.allgather(torch.ones(2 * p), out=out[:, 0]), out)


def test_bad_counts(refusals, comm):
    """Counts that do not add up, of the wrong length, negative or not numbers."""
    p, rank = comm.size, comm.rank
    x = np.arange(3.0) + rank
    words = [f"{p} non-negative element counts"]
    refusals.expect(ValueError, words, lambda: fastreduce.allgather(x, counts=[3] * (p + 1)), x)
    refusals.expect(ValueError, words,
                    lambda: fastreduce.allgather(x, counts=[3] * (p - 1) + [-1]), x)
    refusals.expect(TypeError, ["sequence of"],
                    lambda: fastreduce.allgather(x, counts=["a"] * p), x)
    refusals.expect(TypeError, ["sequence of"], lambda: fastreduce.allgather(x, counts=3), x)
    refusals.expect(ValueError, [f"counts[{rank}] is 4", "3 elements"],
                    lambda: fastreduce.allgather(x, counts=[4] * p), x)
    out = np.full(3 * p + 1, -1.0)
    refusals.expect(ValueError, ["out has", f"needs {3 * p}"],
                    lambda: fastreduce.allgather(x, out=out, counts=[3] * p), x, out)

    y = np.arange(3.0 * p)
    refusals.expect(ValueError, ["counts add up to", f"{3 * p} elements"],
                    lambda: fastreduce.reduce_scatter(y, counts=[3] * (p - 1) + [4]), y)
    refusals.expect(ValueError, words,
                    lambda: fastreduce.reduce_scatter(y, counts=[3] * (p + 1)), y)
    refusals.expect(ValueError, words, lambda: fastreduce.reduce_scatter(
        y, counts=[3] * (p - 1) + [-3]), y)
    if p > 1:
        odd = np.arange(3.0 * p + 1)
        refusals.expect(ValueError, ["do not divide among", "counts="],
                        lambda: fastreduce.reduce_scatter(odd), odd)
        refusals.expect(ValueError, ["do not divide among", "send_counts"],
                        lambda: fastreduce.alltoall(odd), odd)

    refusals.expect(ValueError, ["give both send_counts and recv_counts"],
                    lambda: fastreduce.alltoall(y, send_counts=[3] * p), y)
    refusals.expect(ValueError, ["give both send_counts and recv_counts"],
                    lambda: fastreduce.alltoall(y, recv_counts=[3] * p), y)
    refusals.expect(ValueError, ["send_counts add up to"],
                    lambda: fastreduce.alltoall(y, send_counts=[2] * p, recv_counts=[2] * p), y)
    refusals.expect(ValueError, ["recv_counts", words[0]],
                    lambda: fastreduce.alltoall(y, send_counts=[3] * p,
                                                recv_counts=[3] * (p + 1)), y)
    refusals.expect(ValueError, ["send_counts", words[0]],
                    lambda: fastreduce.alltoall(y, send_counts=[-1] + [3] * (p - 1),
                                                recv_counts=[3] * p), y)
    out = np.full(3 * p, -1.0)
    refusals.expect(ValueError, ["out has", f"needs {4 * p}"],
                    lambda: fastreduce.alltoall(y, out=out, send_counts=[3] * p,
                                                recv_counts=[4] * p),
                    y, out)


def test_out_overlapping_x(refusals, comm):
    """alltoall and reduce_scatter have no in-place form: an out that shares memory with x
    (x itself, or part of it) is refused; so is an all-gather's out that overlaps x
    elsewhere than x's slot."""
    p, rank = comm.size, comm.rank
    buf = np.arange(4.0 * p + 1)
    x = buf[:4 * p]
    refusals.expect(ValueError, ["overlaps"], lambda: fastreduce.alltoall(x, out=buf[1:]), buf)
    refusals.expect(ValueError, ["overlaps"], lambda: fastreduce.alltoall(x, out=x), buf)
    refusals.expect(ValueError, ["overlaps"], lambda: fastreduce.alltoall(
        x, out=buf[1:], send_counts=[4] * p, recv_counts=[4] * p), buf)
    refusals.expect(ValueError, ["overlaps"], lambda: fastreduce.reduce_scatter(x, out=x[:4]), buf)
    refusals.expect(ValueError, ["overlaps"], lambda: fastreduce.reduce_scatter(
        x, out=x[4 * rank:4 * rank + 4], counts=[4] * p), buf)
    t = torch.arange(4.0 * p + 1)
    refusals.expect(ValueError, ["overlaps"], lambda: fastreduce.reduce_scatter(
        t[:4 * p], "max", out=t[4 * p - 3:]), t)
    whole = np.arange(2.0 * p + 1)
    refusals.expect(ValueError, ["overlaps"], lambda: fastreduce.allgather(
        whole[2 * rank + 1:2 * rank + 3], out=whole[:2 * p]), whole)


def test_still_in_step(checks, comm):
    """After every refused call, the ranks are still in step: a good call of each kind."""
    p, rank = comm.size, comm.rank
    got = fastreduce.allgather(np.array([float(rank)]))
    checks.check(same(got, np.arange(float(p))), f"allgather after the refusals: {got}")
    x = torch.full((2,), float(rank))
    fastreduce.broadcast_(x, p - 1)
    checks.check(torch.equal(x, torch.full((2,), float(p - 1))), f"broadcast_ after: {x}")


# -- debug mode ---------------------------------------------------------------------------

@pytest.fixture
def debug(checks):
    """Debug mode on for the case (collective the first time), off after; `checks`."""
    old = fastreduce.set_debug(True)
    checks.check(fastreduce.checks.debug(), "debug mode is not on")
    yield checks
    fastreduce.set_debug(old)


def test_debug_matching_calls(debug, comm):
    """Calls that match on every rank work as outside debug mode, uneven ones included
    (different counts per rank that pair up are no mismatch)."""
    fw, p, rank = framework("torch"), comm.size, comm.rank
    x = torch.full((3,), float(rank))
    fastreduce.broadcast_(x, p - 1)
    debug.check(torch.equal(x, torch.full((3,), float(p - 1))), "broadcast_")
    x = torch.full((3,), float(rank))
    fastreduce.reduce_(x, "max", p - 1)
    debug.check(rank != p - 1 or torch.equal(x, torch.full((3,), float(p - 1))), "reduce_")
    rows = uneven_rows(p)
    got = fastreduce.allgather(torch.full((rows[rank], 2), float(rank)),
                               counts=[2 * n for n in rows])
    want = np.concatenate([np.full((n, 2), float(r)) for r, n in enumerate(rows)])
    debug.check(same(fw.np(got), want), f"allgather uneven {got}")
    counts = reduce_scatter_counts(p)
    got = fastreduce.reduce_scatter(torch.ones(sum(counts)), counts=counts)
    debug.check(same(fw.np(got), np.full(counts[rank], float(p), np.float32)), "reduce_scatter")
    x, send, recv, want = uneven_alltoall_case(fw, "float64", p, rank, "debug alltoall")
    got = fastreduce.alltoall(x, send_counts=send, recv_counts=recv)
    debug.check(same(fw.np(got), want), f"alltoall uneven {got}, expected {want}")
    got = fastreduce.gather(torch.full((2,), float(rank)), p - 1)
    debug.check(got is None if rank != p - 1 else
                same(fw.np(got), np.repeat(np.arange(float(p)), 2).astype(np.float32)), "gather")
    got = fastreduce.scatter(torch.arange(2.0 * p) if rank == p - 1 else None, p - 1,
                             out=None if rank == p - 1 else torch.zeros(2))
    debug.check(same(fw.np(got), np.arange(2.0 * rank, 2.0 * rank + 2, dtype=np.float32)),
                f"scatter {got}")


def _root(p, rank):
    return (lambda: fastreduce.broadcast_(torch.zeros(3), 0 if rank == 0 else 1),
            ["broadcast_", "root", "rank 0 passed 0", "passed 1"])


def _reduce_root(p, rank):
    return (lambda: fastreduce.reduce_(np.zeros(3), "sum", p - 1 if rank else 0),
            ["reduce_", "root"])


def _gather_root(p, rank):
    root = 0 if rank == 0 else 1
    return (lambda: fastreduce.gather(torch.zeros(2), root), ["gather", "root"])


def _scatter_root(p, rank):
    root = 0 if rank == 0 else 1
    return (lambda: fastreduce.scatter(torch.zeros(2 * p) if rank == root else None, root,
                                       out=None if rank == root else torch.zeros(2)),
            ["scatter", "root"])


def _reduce_op(p, rank):
    return (lambda: fastreduce.reduce_(torch.zeros(3), "sum" if rank == 0 else "max", p - 1),
            ["reduce_", "op", "rank 0 passed 'sum'", "'max'"])


def _reduce_scatter_op(p, rank):
    return (lambda: fastreduce.reduce_scatter(np.zeros(2 * p), "max" if rank == 1 else "sum"),
            ["reduce_scatter", "op", "rank 1 passed 'max'"])


def _allgather_dtype(p, rank):
    dtype = torch.float64 if rank == 0 else torch.float32
    return (lambda: fastreduce.allgather(torch.zeros(3, dtype=dtype)),
            ["allgather", "dtype", "float64", "float32"])


def _alltoall_dtype(p, rank):
    dtype = np.int64 if rank == p - 1 else np.int8
    return (lambda: fastreduce.alltoall(np.zeros(2 * p, dtype)), ["alltoall", "dtype", "int64"])


def _broadcast_dtype(p, rank):
    dtype = torch.bfloat16 if rank == 0 else torch.float16
    return (lambda: fastreduce.broadcast_(torch.zeros(4, dtype=dtype)),
            ["broadcast_", "dtype", "bfloat16", "float16"])


def _allgather_count(p, rank):
    n = 4 if rank == p - 1 else 3
    return (lambda: fastreduce.allgather(np.zeros(n)), ["allgather", "count",
                                                        f"rank {p - 1} passed 4"])


def _allgather_counts(p, rank):
    counts = [2] * p if rank == 0 else [1] * (p - 1) + [p + 1]
    return (lambda: fastreduce.allgather(np.zeros(counts[rank]), counts=counts),
            ["allgather", "count"])


def _gather_count(p, rank):
    n = 5 if rank == 1 else 2
    return (lambda: fastreduce.gather(torch.zeros(n), 0), ["gather", "count",
                                                            "rank 1 passed 5"])


def _scatter_count(p, rank):
    return (lambda: fastreduce.scatter(torch.zeros(2 * p) if rank == 0 else None, 0,
                                       out=None if rank == 0 else torch.zeros(3)),
            ["scatter", "count"])


def _reduce_scatter_counts(p, rank):
    counts = [2] * p if rank == 0 else [1] + [2] * (p - 2) + [3]
    return (lambda: fastreduce.reduce_scatter(torch.zeros(2 * p), counts=counts),
            ["reduce_scatter", "count"])


def _broadcast_count(p, rank):
    n = 6 if rank == p - 1 else 5
    return (lambda: fastreduce.broadcast_(np.zeros(n)), ["broadcast_", "count"])


def _reduce_count(p, rank):
    n = 6 if rank == 0 else 5
    return (lambda: fastreduce.reduce_(np.zeros(n), "max", p - 1), ["reduce_", "count"])


def _alltoall_count(p, rank):
    n = 3 * p if rank == 0 else 2 * p
    return (lambda: fastreduce.alltoall(torch.zeros(n)), ["alltoall", "count"])


def _different_calls(p, rank):
    x = torch.zeros(2)
    return (lambda: fastreduce.gather(x) if rank == 0 else fastreduce.allgather(x),
            ["call", "gather", "allgather"])


MISMATCHES = [_root, _reduce_root, _gather_root, _scatter_root, _reduce_op,
              _reduce_scatter_op, _allgather_dtype, _alltoall_dtype, _broadcast_dtype,
              _allgather_count, _allgather_counts, _gather_count, _scatter_count,
              _reduce_scatter_counts, _broadcast_count, _reduce_count, _alltoall_count,
              _different_calls]


@pytest.mark.mpi(ranks=(2, 3, 4))
@pytest.mark.parametrize("mismatch", [pytest.param(m, id=m.__name__[1:]) for m in MISMATCHES])
def test_debug_mismatch(mismatch, debug, comm):
    """One root, dtype, op or count differs between the ranks: the same CollectiveMismatch
    on every rank, naming it; the communicator still works after."""
    call, words = mismatch(comm.size, comm.rank)
    debug.expect_everywhere(call, words, same_message=True)
    got = fastreduce.allgather(np.array([comm.rank]))
    debug.check(same(got, np.arange(comm.size)), f"allgather after the mismatch: {got}")


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_debug_alltoall_counts_that_do_not_pair_up(debug, comm):
    """Uneven all-to-all counts are checked pairwise: rank 0 expecting 2 elements from the
    last rank, which sends 1, is a CollectiveMismatch on every rank naming the pair (their
    totals and every other pair agree); then two pairs at once."""
    p, rank = comm.size, comm.rank
    send, recv = [1] * p, [1] * p
    if rank == 0:
        recv[p - 1] = 2
    x = np.zeros(p)
    out = np.zeros(sum(recv))
    debug.expect_everywhere(
        lambda: fastreduce.alltoall(x, out=out, send_counts=send, recv_counts=recv),
        ["alltoall", "do not pair up", f"rank {p - 1} sends 1 elements to rank 0, which "
         f"expects 2"], same_message=True)
    # the last rank sends 2 to rank 0 and 0 to itself (its total unchanged), rank 0 still
    # expects 1 from it and the last rank 1 from itself
    send = [1] * p
    if rank == p - 1:
        send[0], send[p - 1] = 2, 0
    x = np.zeros(sum(send))
    debug.expect_everywhere(
        lambda: fastreduce.alltoall(x, send_counts=send, recv_counts=[1] * p),
        ["do not pair up", f"rank {p - 1} sends 2 elements to rank 0, which expects 1",
         f"rank {p - 1} sends 0 elements to rank {p - 1}, which expects 1"], same_message=True)
