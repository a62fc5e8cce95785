"""The data-movement collectives on CUDA memory, over the fake CUDA runtime
(tests/support/fakecuda): broadcast_, reduce_, allgather, reduce_scatter, alltoall, gather,
scatter, send and recv (src/fastreduce/backend/coll_movement.pxi).

Every call, each in its forms (in place, uneven counts, reductions), on 1, 2 and 4 ranks
(profile fakecuda):

  host path    the results on fake device memory equal the host path's for the same inputs,
               and both equal numpy's, computed from every rank's deterministic inputs
  copies       staged: the copies of each rank, in order, with their direction and bytes, as
               the fake runtime ran them (its counters and copy log) and as fastreduce counts
               them; none from pageable memory (the fake tells pinned from pageable: its
               pageable_async_copies counts async copies whose host side was not allocated
               by cudaHostAlloc); all on the producer's stream
  ordering     the input is written by a delayed "kernel" on the producer's stream just
               before the call, and that is what gets sent; the result is seen by work queued
               on that stream after the call (copies out slowed down); without fastreduce's
               host waits the same test fails (on more than one rank)
  direct       a CUDA-aware MPI in direct mode: the device pointers go to MPI (no copies, no
               pinned memory, fastreduce's direct_calls), after a wait for the producer;
               avg (divided on the host) staged; send and recv staged until the
               communicator's ranks have agreed on the GPU path
  managed      managed memory: MPI reads it on the host once the producer is done, no copies
  chunks       with a staging chunk smaller than the call, the calls of equal blocks are
               pipelined: each chunk of each block copied in and out once, in order, on the
               staging context's streams, the results, the stream ordering (and that its
               test can fail); the uneven calls and send/recv still staged whole
  pinned       the staging memory is reused by every call of a size held already
  bad input    a device out for a host x (or the reverse, another device, managed with
               device memory): ValueError before any MPI call (one rank alone makes them)
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import fakecuda
import numpy as np
import pytest
from fakecuda import FakeCudaArray, FakeCudaTensor, Stream
from mpi4py import MPI

import fastreduce
from fastreduce import gpupaths
from fastreduce.backend import cudart as _cuda

pytestmark = pytest.mark.mpi(ranks=(1, 2, 4), profile="fakecuda")

ITEM = 4  # float32
N = 1001  # elements of each rank's x: broadcast_, reduce_, allgather, gather, send
K = 250  # elements of each rank's part: reduce_scatter, alltoall, scatter
SENTINEL = -7.0  # what out holds before the call
DELAY_US = 20_000  # the "kernel" that writes the input just before the call
SLOW_DELAY_US = 100_000  # the same where the test must fail without fastreduce's waits


@pytest.fixture(scope="module", autouse=True)
def not_cuda_aware():
    """The MPI declared not CUDA-aware for the module (every GPU call staged), the fake
    device quiet at its end."""
    fastreduce.set_cuda_aware(False)
    gpupaths.set_gpu_path(None)
    yield
    fakecuda.quiesce()
    gpupaths.set_gpu_path(None)
    fastreduce.set_cuda_aware(None)


# --- the cases: each rank's inputs, what it must get, the copies it must make ----------------
def values(n: int, r: int, salt: int) -> np.ndarray:
    """Rank r's n values (small integers: exact sums in float32), different for each salt so
    that stale data of an earlier call never passes for this one's."""
    return ((np.arange(n, dtype=np.int64) * 7 + r * 101 + salt * 13) % 1000 + 1).astype(
        np.float32)


def blank(n: int) -> np.ndarray:
    return np.full(n, SENTINEL, np.float32)


def reduced(stack: np.ndarray, op: str, size: int) -> np.ndarray:
    """numpy's reduction of the ranks' values (axis 0), in float32."""
    if op == "max":
        return stack.max(axis=0)
    total = stack.sum(axis=0, dtype=np.float32)
    return total / np.float32(size) if op == "avg" else total


@dataclass
class Case:
    """One call on one rank."""

    x: np.ndarray | None  # this rank's x (None: scatter off the root)
    out: np.ndarray | None  # out's contents before the call (None: no out on this rank)
    call: Callable  # call(x, out) -> what fastreduce returned
    result: str | None  # "x" or "out": the buffer that must hold `want` afterwards
    want: np.ndarray | None
    returns: object  # "x", "out", None, or recv's (source, tag)
    copies: list  # the staged path's copies on this rank, in order: (kind, bytes)
    calls: int = 1  # fastreduce calls made on GPU memory
    view: tuple | None = None  # ("x", start, n): x is out[start:start+n]; ("out", ...): reverse
    kept: bool = False  # x keeps its values
    staged_anyway: bool = False  # avg: divided on the host, so staged even in direct mode


CALLS = ["broadcast_", "reduce_-sum", "reduce_-max", "reduce_-avg", "allgather",
         "allgather-in-place", "allgather-counts", "allgather-equal-counts",
         "reduce_scatter-sum", "reduce_scatter-max", "reduce_scatter-avg",
         "reduce_scatter-counts", "reduce_scatter-equal-counts", "alltoall", "alltoall-counts",
         "gather", "gather-in-place", "scatter", "scatter-in-place", "send-recv",
         "send-recv-any"]


def build(name: str, rank: int, size: int, salt: int) -> Case | None:
    """The case `name` on `rank` of `size` (None: send and recv on one rank)."""
    def v(n, r):
        return values(n, r, salt)

    root = size - 1  # not rank 0 where there are several
    is_root = rank == root
    gathered = np.concatenate([v(N, r) for r in range(size)])
    if name == "broadcast_":
        return Case(v(N, rank), None, lambda x, out: fastreduce.broadcast_(x, root), "x",
                    v(N, root), "x", [("D2H", N * ITEM)] if is_root else [("H2D", N * ITEM)])
    if name.startswith("reduce_-"):
        op = name.partition("-")[2]
        want = reduced(np.stack([v(N, r) for r in range(size)]), op, size)
        return Case(v(N, rank), None, lambda x, out: fastreduce.reduce_(x, op, root),
                    "x" if is_root else None, want if is_root else None, "x",
                    [("D2H", N * ITEM)] + ([("H2D", N * ITEM)] if is_root else []),
                    kept=not is_root, staged_anyway=op == "avg")
    if name in ("allgather", "allgather-equal-counts"):  # equal counts: the same call
        counts = [N] * size if name == "allgather-equal-counts" else None
        return Case(v(N, rank), blank(size * N),
                    lambda x, out: fastreduce.allgather(x, out=out, counts=counts),
                    "out", gathered, "out", [("D2H", N * ITEM), ("H2D", size * N * ITEM)],
                    kept=True)
    if name == "allgather-in-place":
        out = blank(size * N)
        out[rank * N:(rank + 1) * N] = v(N, rank)
        return Case(v(N, rank), out, lambda x, out: fastreduce.allgather(x, out=out), "out",
                    gathered, "out", [("D2H", size * N * ITEM), ("H2D", size * N * ITEM)],
                    view=("x", rank * N, N))
    if name == "allgather-counts":
        counts = [200 + 37 * r for r in range(size)]
        return Case(v(counts[rank], rank), blank(sum(counts)),
                    lambda x, out: fastreduce.allgather(x, out=out, counts=counts), "out",
                    np.concatenate([v(counts[r], r) for r in range(size)]), "out",
                    [("D2H", counts[rank] * ITEM), ("H2D", sum(counts) * ITEM)], kept=True)
    if name.startswith("reduce_scatter-"):
        op = name.partition("-")[2]
        counts = ([100 + 50 * r for r in range(size)] if op == "counts" else
                  [K] * size if op == "equal-counts" else None)
        op = "sum" if op.endswith("counts") else op
        total = sum(counts) if counts else size * K
        full = reduced(np.stack([v(total, r) for r in range(size)]), op, size)
        start = sum(counts[:rank]) if counts else rank * K
        mine = counts[rank] if counts else K
        return Case(v(total, rank), blank(mine),
                    lambda x, out: fastreduce.reduce_scatter(x, op, out=out, counts=counts),
                    "out", full[start:start + mine], "out",
                    [("D2H", total * ITEM), ("H2D", mine * ITEM)], kept=True,
                    staged_anyway=op == "avg")
    if name == "alltoall":
        want = np.concatenate([v(size * K, j)[rank * K:(rank + 1) * K] for j in range(size)])
        return Case(v(size * K, rank), blank(size * K),
                    lambda x, out: fastreduce.alltoall(x, out=out), "out", want, "out",
                    [("D2H", size * K * ITEM), ("H2D", size * K * ITEM)], kept=True)
    if name == "alltoall-counts":
        def sends(r, j):  # elements from rank r to rank j
            return 20 + 10 * ((r + 2 * j) % 4) + 3 * r

        send = [sends(rank, j) for j in range(size)]
        recv = [sends(j, rank) for j in range(size)]
        parts = []
        for j in range(size):
            start = sum(sends(j, i) for i in range(rank))
            parts.append(v(sum(sends(j, i) for i in range(size)), j)[start:start + recv[j]])
        return Case(v(sum(send), rank), blank(sum(recv)),
                    lambda x, out: fastreduce.alltoall(x, out=out, send_counts=send,
                                                       recv_counts=recv),
                    "out", np.concatenate(parts), "out",
                    [("D2H", sum(send) * ITEM), ("H2D", sum(recv) * ITEM)], kept=True)
    if name == "gather" or (name == "gather-in-place" and not is_root):
        return Case(v(N, rank), blank(size * N) if is_root else None,
                    lambda x, out: fastreduce.gather(x, root, out=out),
                    "out" if is_root else None, gathered if is_root else None,
                    "out" if is_root else None,
                    [("D2H", N * ITEM)] + ([("H2D", size * N * ITEM)] if is_root else []),
                    kept=True)
    if name == "gather-in-place":
        out = blank(size * N)
        out[root * N:(root + 1) * N] = v(N, root)
        return Case(v(N, rank), out, lambda x, out: fastreduce.gather(x, root, out=out), "out",
                    gathered, "out", [("D2H", size * N * ITEM), ("H2D", size * N * ITEM)],
                    view=("x", root * N, N))
    if name.startswith("scatter"):
        whole = v(size * K, root)
        want = whole[rank * K:(rank + 1) * K]

        def call(x, out):
            return fastreduce.scatter(x, root, out=out)

        if is_root and name == "scatter-in-place":  # the root's part stays where it is in x
            return Case(whole, None, call, "out", want, "out", [("D2H", size * K * ITEM)],
                        view=("out", root * K, K), kept=True)
        return Case(whole if is_root else None, blank(K), call, "out", want, "out",
                    ([("D2H", size * K * ITEM)] if is_root else []) + [("H2D", K * ITEM)],
                    kept=is_root)
    if name.startswith("send-recv"):
        if size == 1:
            return None
        partner, tag = rank ^ 1, 7  # pairs 0-1, 2-3
        source, which = (None, None) if name == "send-recv-any" else (partner, tag)

        def call(x, out):
            if rank % 2 == 0:
                fastreduce.send(x, partner, tag)
                return fastreduce.recv(out, source, which)
            status = fastreduce.recv(out, source, which)
            fastreduce.send(x, partner, tag)
            return status

        copies = [("D2H", N * ITEM), ("H2D", N * ITEM)]
        return Case(v(N, rank), blank(N), call, "out", v(N, partner), (partner, tag),
                    copies if rank % 2 == 0 else copies[::-1], calls=2, kept=True)
    raise AssertionError(name)


def case_of(name: str, request, comm, phase: int = 0) -> Case:
    """The case for this rank; its values salted by the test's id and `phase` (the same on
    every rank); send and recv skipped on one rank (on every rank alike)."""
    salt = zlib.crc32(request.node.nodeid.encode()) % 1009 + phase
    case = build(name, comm.rank, comm.size, salt)
    if case is None:
        pytest.skip("send and recv need a partner rank")
    return case


# --- buffers on the host and in fake device memory -----------------------------------------
class _Part:
    """Elements [start, start + n) of another fake device array: the same memory and
    producer stream (an in-place call's x within out, or out within x)."""

    _offset = 0

    @property
    def ptr(self) -> int:
        return self._buf.ptr + self._offset


class ArrayPart(_Part, FakeCudaArray):
    pass


class TensorPart(_Part, FakeCudaTensor):
    pass


def part(base: FakeCudaArray, start: int, n: int) -> FakeCudaArray:
    p = object.__new__(TensorPart if isinstance(base, FakeCudaTensor) else ArrayPart)
    p.__dict__.update(base.__dict__)  # its memory (_buf), stream, dtype, device
    p.shape = (n,)
    p._offset = start * base.dtype.itemsize
    p.exports, p.last_export_stream = 0, None
    if isinstance(base, FakeCudaTensor):
        p._c_shape = (ctypes.c_int64 * 1)(n)
    return p


def on_host(case: Case):
    """(x, out) as numpy arrays (views of each other where the case is in place)."""
    if case.view is None:
        return (None if case.x is None else case.x.copy(),
                None if case.out is None else case.out.copy())
    _, start, n = case.view
    if case.view[0] == "x":
        out = case.out.copy()
        return out[start:start + n], out
    x = case.x.copy()
    return x, x[start:start + n]


def on_device(case: Case, cls, stream: Stream, delay_us: int, device_type=fakecuda.KDL_CUDA):
    """(x, out) in fake device memory, producer `stream`: out's contents written at once,
    the input (x, or out holding x) by a "kernel" that runs delay_us later."""
    def new(a):
        return cls(a.shape, a.dtype, stream=stream, device_type=device_type)

    if case.view is not None:
        _, start, n = case.view
        base = new(case.out if case.view[0] == "x" else case.x)
        base.write(case.out if case.view[0] == "x" else case.x, delay_us=delay_us)
        inner = part(base, start, n)
        return (inner, base) if case.view[0] == "x" else (base, inner)
    x = None if case.x is None else new(case.x)
    out = None if case.out is None else new(case.out)
    if out is not None:
        out.write(case.out)
    if x is not None:
        x.write(case.x, delay_us=delay_us)
    return x, out


def contents(buf) -> np.ndarray:
    return buf.to_numpy() if hasattr(buf, "to_numpy") else np.array(buf)


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and got.tobytes() == want.tobytes()


def result_ok(case: Case, x, out) -> bool:
    if case.result is None:
        return True
    return same(contents(x if case.result == "x" else out), case.want)


def check_outcome(case: Case, x, out, ret, what: str, check) -> None:
    """The result, x kept where the call only reads it, and what the call returned."""
    if case.result is not None:
        got = contents(x if case.result == "x" else out)
        check(same(got, case.want), f"{what}: result {got[:8]}..., expected {case.want[:8]}...")
    if case.kept:
        check(same(contents(x), case.x), f"{what}: x changed")
    if case.returns in ("x", "out"):
        check(ret is (x if case.returns == "x" else out), f"{what}: returned {ret!r}")
    elif isinstance(case.returns, tuple):
        check(tuple(ret) == case.returns, f"{what}: recv returned {ret}, not {case.returns}")
    else:
        check(ret is None, f"{what}: returned {ret!r}, not None")


def run(case: Case, x, out, current: Stream | None = None):
    """The case's call, with `current` as the framework's current stream (exchange API)."""
    fakecuda.set_current_stream(current)
    try:
        return case.call(x, out)
    finally:
        fakecuda.set_current_stream(None)


def start_counting() -> None:
    """Zero fastreduce's counters and the fake's, and log the copies the streams run."""
    fakecuda.quiesce()
    gpupaths.reset_gpu_copy_counts()
    fakecuda.reset_counters()
    fakecuda.log_copies(256)


def counted():
    """(fastreduce's counts, the fake's, the copies run: (kind, bytes, stream)) since
    start_counting(), once every stream is idle; launch_write's writes left out."""
    fakecuda.quiesce()
    log = [(c["kind"], c["bytes"], c["stream"]) for c in fakecuda.copy_log()
           if c["kind"] != "write"]
    fakecuda.log_copies(0)
    return gpupaths.gpu_copy_counts(), fakecuda.counters(), log


def check_copies(copies: list, mine: dict, fake: dict, log: list, what: str, check) -> None:
    """The copies made, as the fake ran them and as both sides counted them; none pageable,
    none of another kind, no whole-device synchronisation."""
    d2h = [b for kind, b in copies if kind == "D2H"]
    h2d = [b for kind, b in copies if kind == "H2D"]
    want = {"d2h_copies": len(d2h), "h2d_copies": len(h2d), "d2h_bytes": sum(d2h),
            "h2d_bytes": sum(h2d)}
    check({k: fake[k] for k in want} == want,
          f"{what}: the fake runtime counted {({k: fake[k] for k in want})}, expected {want}")
    check({k: mine[k] for k in want} == want,
          f"{what}: fastreduce counted {({k: mine[k] for k in want})}, expected {want}")
    check([(kind, b) for kind, b, _ in log] == copies,
          f"{what}: copies run {[(kind, b) for kind, b, _ in log]}, expected {copies}")
    check(fake["pageable_async_copies"] == 0, f"{what}: {fake['pageable_async_copies']} "
          f"asynchronous copies from or to pageable host memory")
    check(fake["bad_copies"] == fake["d2d_copies"] == fake["device_syncs"] == 0,
          f"{what}: bad copies, device-to-device copies or device syncs: {fake}")


def read_on(stream: Stream, g) -> np.ndarray:
    """g's contents as work queued on `stream` now sees them (that stream alone waited for)."""
    got = np.empty(g.shape, g.dtype)
    fakecuda.check(fakecuda.lib().cudaMemcpyAsync(got.ctypes.data, g.ptr, g.nbytes,
                                                  fakecuda.DEVICE_TO_HOST, stream.handle))
    stream.synchronize()
    return got


def staged_run(name: str, cls, request, comm, where: str, check):
    """The case on the host and, counted, on fake device memory of `cls` whose input a
    delayed kernel on the producer's stream writes: both outcomes checked, and the device's
    result against the host's. (case, (x, out, producer, fastreduce's counts, the fake's,
    the copies run, the checks' label))."""
    case = case_of(name, request, comm)
    hx, hout = on_host(case)
    hret = case.call(hx, hout)
    check_outcome(case, hx, hout, hret, f"{name} host path", check)
    producer = Stream()
    start_counting()
    x, out = on_device(case, cls, producer, DELAY_US)
    ret = run(case, x, out, producer if cls is FakeCudaTensor else None)
    mine, fake, log = counted()
    what = f"{name} {cls.__name__} {where}"
    check_outcome(case, x, out, ret, what, check)
    if case.result is not None:
        check(same(contents(x if case.result == "x" else out),
                   contents(hx if case.result == "x" else hout)), f"{what}: not the host's")
    return case, (x, out, producer, mine, fake, log, what)


def seen_later(case: Case, name: str, check) -> None:
    """Exchange API, copies out slowed down (fastreduce does not wait for them on the host):
    work queued on the producer's stream after the call sees the result."""
    producer = Stream()
    x, out = on_device(case, FakeCudaTensor, producer, DELAY_US)
    run(case, x, out, producer)
    if case.result is not None:
        buf = x if case.result == "x" else out
        check(same(read_on(producer, buf), case.want),
              f"{name}: later work on the producer's stream sees the result")
    if case.kept:
        check(same(read_on(producer, x), case.x), f"{name}: x kept")
    fakecuda.quiesce()


# --- staged: the host path's results, the copies, the producer's stream -------------------
@pytest.mark.parametrize("cls", [FakeCudaArray, FakeCudaTensor], ids=["dlpack", "exchange-api"])
@pytest.mark.parametrize("name", CALLS)
def test_staged(name, cls, request, comm, checks):
    """An MPI that is not CUDA-aware: the host path's results (and numpy's); the copies of
    each rank, each way, in order, with their bytes, from pinned memory, on the producer's
    stream; the input written by a delayed kernel on the producer's stream is what is sent;
    the path counted as staged."""
    check = checks.check
    case, run_ = staged_run(name, cls, request, comm, f"rank {comm.rank}", check)
    x, out, producer, mine, fake, log, what = run_
    check_copies(case.copies, mine, fake, log, what, check)
    streams = {s for *_, s in log}
    if cls is FakeCudaTensor:  # the framework's current stream: the producer's
        check(streams <= {producer.handle}, f"{what}: copies on {streams}, not on the "
              f"producer's stream {producer.handle}")
    else:  # the stream fastreduce passed to __dlpack__, ordered after the producer's
        exported = {int(g.last_export_stream) for g in (x, out)
                    if g is not None and g.last_export_stream is not None}
        check(len(streams) <= 1 and streams <= exported,
              f"{what}: copies on {streams}, exported to {exported}")
    check((mine["staged_calls"], mine["direct_calls"]) == (case.calls, 0),
          f"{what}: path counts {mine}, expected {case.calls} staged")


@pytest.mark.parametrize("name", CALLS)
def test_result_before_later_work_on_the_producers_stream(name, request, monkeypatch, comm,
                                                          checks):
    """Exchange API, copies out slowed down (fastreduce does not wait for them on the host):
    work queued on the producer's stream after the call sees the result."""
    monkeypatch.setenv("FAKECUDA_H2D_DELAY_US", "20000")
    seen_later(case_of(name, request, comm), name, checks.check)


def ordered(case: Case, cls, delay_us: int, skip_waits: bool) -> bool:
    """Whether the call sends what a delayed kernel on the producer's stream wrote (this
    rank's result is right), with or without fastreduce's host waits."""
    producer = Stream()
    x, out = on_device(case, cls, producer, delay_us)
    _cuda._set_skip_waits(skip_waits)
    try:
        run(case, x, out, producer if cls is FakeCudaTensor else None)
    finally:
        _cuda._set_skip_waits(False)
    ok = result_ok(case, x, out)
    fakecuda.quiesce()
    return ok


@pytest.mark.parametrize("cls", [FakeCudaArray, FakeCudaTensor], ids=["dlpack", "exchange-api"])
@pytest.mark.parametrize("name", CALLS)
def test_ordering_test_can_fail(name, cls, request, comm, checks):
    """A kernel writes the input just before the call: with fastreduce's waits every rank
    gets the right result; without them (the kernel slower) some rank does not (on more
    than one rank). So the stream ordering is what the other tests see."""
    if comm.size == 1:
        pytest.skip("one rank's result is its own input, which arrives in the end anyway")
    good = ordered(case_of(name, request, comm, 0), cls, DELAY_US, False)
    bad = ordered(case_of(name, request, comm, 1), cls, SLOW_DELAY_US, True)
    goods, bads = comm.allgather(good), comm.allgather(bad)
    checks.check(all(goods), f"{name} {cls.__name__}: wrong results with the waits: {goods}")
    checks.check(not all(bads), f"{name} {cls.__name__}: the ordering test cannot fail")


# --- staged in pipelined chunks -------------------------------------------------------------
CHUNK = 1024  # bytes: the fixed staging chunk of the pipelined cases

# name: (elements of a rank's block, blocks in the call, blocks this rank sends, blocks copied
# back to it), for the calls whose ranks move blocks of one size (root: the last rank)
PIPELINED = {
    "broadcast_": lambda root, p: (N, 1, int(root), int(not root)),
    "reduce_-sum": lambda root, p: (N, 1, 1, int(root)),
    "reduce_-max": lambda root, p: (N, 1, 1, int(root)),
    "reduce_-avg": lambda root, p: (N, 1, 1, int(root)),
    "allgather": lambda root, p: (N, p, 1, p),
    "allgather-in-place": lambda root, p: (N, p, 1, p),
    "allgather-equal-counts": lambda root, p: (N, p, 1, p),
    "gather": lambda root, p: (N, p, 1, p if root else 0),
    "gather-in-place": lambda root, p: (N, p, 1, p if root else 0),
    "scatter": lambda root, p: (K, p, p if root else 0, 1),
    "scatter-in-place": lambda root, p: (K, p, p if root else 0, 0 if root else 1),
    "reduce_scatter-sum": lambda root, p: (K, p, p, 1),
    "reduce_scatter-max": lambda root, p: (K, p, p, 1),
    "reduce_scatter-avg": lambda root, p: (K, p, p, 1),
    "reduce_scatter-equal-counts": lambda root, p: (K, p, p, 1),
    "alltoall": lambda root, p: (K, p, p, p),
}


def chunked_copies(name: str, rank: int, size: int) -> tuple[list, list] | None:
    """The bytes of each copy in and each copy out, in order, of `name` staged with CHUNK:
    chunk k of the call is bytes [k q, (k + 1) q) of every block, q = CHUNK / (blocks in the
    call) rounded down to 16 bytes, and each block's part is its own copy. None where one
    chunk holds the call (staged whole) or the call is uneven (counts that differ) or
    point-to-point."""
    if name not in PIPELINED:
        return None
    elements, blocks, sent, back = PIPELINED[name](rank == size - 1, size)
    block = elements * ITEM
    if CHUNK >= block * blocks:
        return None
    piece = max(16, CHUNK // blocks // 16 * 16)
    parts = [min(piece, block - k) for k in range(0, block, piece)]
    return [n for n in parts for _ in range(sent)], [n for n in parts for _ in range(back)]


@pytest.fixture
def chunked():
    """The staging chunk fixed at CHUNK bytes on every rank, restored afterwards."""
    old = gpupaths.set_staging_chunk(CHUNK)
    yield
    fakecuda.quiesce()
    gpupaths.set_staging_chunk(old)


@pytest.mark.parametrize("cls", [FakeCudaArray, FakeCudaTensor], ids=["dlpack", "exchange-api"])
@pytest.mark.parametrize("name", CALLS)
def test_staged_in_chunks(name, cls, chunked, request, comm, checks):
    """Staged with a chunk smaller than the call: the host path's results; each chunk of
    each block copied in and out once, in order, from pinned memory, on the staging
    context's two streams (not the producer's); the uneven calls and send/recv still in one
    copy each way (their peers cut alike or not at all)."""
    check = checks.check
    case, run_ = staged_run(name, cls, request, comm,
                            f"rank {comm.rank} of {comm.size}, chunks of {CHUNK} B", check)
    x, out, producer, mine, fake, log, what = run_
    check((mine["staged_calls"], mine["direct_calls"]) == (case.calls, 0),
          f"{what}: path counts {mine}, expected {case.calls} staged")
    plan = chunked_copies(name, comm.rank, comm.size)
    if plan is None:  # staged whole
        check_copies(case.copies, mine, fake, log, what, check)
        return
    d2h, h2d = plan
    want = {"d2h_copies": len(d2h), "h2d_copies": len(h2d), "d2h_bytes": sum(d2h),
            "h2d_bytes": sum(h2d)}
    for counter, counts in (("fake runtime", fake), ("fastreduce", mine)):
        check({k: counts[k] for k in want} == want,
              f"{what}: the {counter} counted {({k: counts[k] for k in want})}, expected {want}")
    for kind, sizes in (("D2H", d2h), ("H2D", h2d)):
        run_ = [b for k, b, _ in log if k == kind]
        check(run_ == sizes, f"{what}: {kind} copies run {run_}, expected {sizes}")
    streams = {k: {s for kk, _, s in log if kk == k} for k in ("D2H", "H2D")}
    producers = {producer.handle} | {int(g.last_export_stream) for g in (x, out)
                                     if g is not None and g.last_export_stream is not None}
    check(all(len(v) <= 1 and not v & producers for v in streams.values()),
          f"{what}: copies on {streams}; one stream each way expected, not the producer's "
          f"{producers}")
    check(fake["pageable_async_copies"] == fake["bad_copies"] == fake["device_syncs"] == 0,
          f"{what}: pageable or bad copies, or device syncs: {fake}")


@pytest.mark.parametrize("name", list(PIPELINED))
def test_chunks_in_order(name, chunked, request, monkeypatch, comm, checks):
    """Staged in chunks, a kernel writes the input just before the call: with fastreduce's
    waits every rank gets the right result, without them (the kernel slower) some rank does
    not; copies out slowed down, later work on the producer's stream sees the result."""
    if comm.size > 1:
        good = ordered(case_of(name, request, comm, 0), FakeCudaTensor, DELAY_US, False)
        bad = ordered(case_of(name, request, comm, 1), FakeCudaTensor, SLOW_DELAY_US, True)
        goods, bads = comm.allgather(good), comm.allgather(bad)
        checks.check(all(goods), f"{name}: wrong results with the waits: {goods}")
        checks.check(not all(bads), f"{name}: the ordering test cannot fail")
    monkeypatch.setenv("FAKECUDA_H2D_DELAY_US", "5000")
    seen_later(case_of(name, request, comm, 2), name, checks.check)


# --- direct: a CUDA-aware MPI takes the device pointers ------------------------------------
@pytest.fixture
def direct_settings():
    """A CUDA-aware MPI, the GPU path mode direct (a new generation of the settings: each
    communicator agrees on them again at its next GPU call); back after the case."""
    fastreduce.set_cuda_aware(True)
    gpupaths.set_gpu_path("direct")
    yield
    fakecuda.quiesce()
    gpupaths.set_gpu_path(None)
    fastreduce.set_cuda_aware(False)


def agree() -> None:
    """A GPU collective: the default communicator's ranks agree on the GPU path."""
    fastreduce.broadcast_(FakeCudaArray.from_numpy(np.zeros(1, np.float32)), 0)
    fakecuda.quiesce()


@pytest.fixture
def direct(direct_settings):
    """Direct mode, the ranks' agreement made (outside what the case counts)."""
    support = gpupaths.device_pointer_support()
    assert support.blocking, f"a CUDA-aware MPI, yet no blocking call takes pointers: {support}"
    agree()


@pytest.mark.parametrize("cls", [FakeCudaArray, FakeCudaTensor], ids=["dlpack", "exchange-api"])
@pytest.mark.parametrize("name", CALLS)
def test_direct(name, cls, direct, request, comm, checks):
    """The device pointers go to MPI, after a wait for the producer's stream (the delayed
    kernel's input is what is sent): no copies, no pinned memory, counted direct; avg,
    divided on the host, staged."""
    check = checks.check
    case = case_of(name, request, comm)
    producer = Stream()
    start_counting()
    x, out = on_device(case, cls, producer, DELAY_US)
    ret = run(case, x, out, producer if cls is FakeCudaTensor else None)
    mine, fake, log = counted()
    what = f"{name} {cls.__name__} direct, rank {comm.rank}"
    check_outcome(case, x, out, ret, what, check)
    if case.staged_anyway:
        check_copies(case.copies, mine, fake, log, what, check)
        check((mine["staged_calls"], mine["direct_calls"]) == (case.calls, 0),
              f"{what}: path counts {mine}, expected {case.calls} staged")
        return
    check_copies([], mine, fake, log, what, check)
    check((mine["direct_calls"], mine["staged_calls"]) == (case.calls, 0),
          f"{what}: path counts {mine}, expected {case.calls} direct")
    check(fake["host_allocs"] == mine["pinned_allocs"] == 0, f"{what}: pinned memory "
          f"allocated: fake {fake['host_allocs']}, counted {mine['pinned_allocs']}")
    check(fake["stream_syncs"] >= case.calls and mine["stream_syncs"] >= case.calls,
          f"{what}: waited for the producer's stream: fake {fake}, counted {mine}")


@pytest.mark.parametrize("name", ["broadcast_", "allgather", "gather", "scatter", "send-recv"])
def test_direct_ordering_test_can_fail(name, direct, request, comm, checks):
    """Direct: without the wait for the producer's stream, MPI reads the device memory
    before the delayed kernel has written it (on more than one rank)."""
    if comm.size == 1:
        pytest.skip("one rank's result is its own input, which arrives in the end anyway")
    good = ordered(case_of(name, request, comm, 0), FakeCudaArray, DELAY_US, False)
    bad = ordered(case_of(name, request, comm, 1), FakeCudaArray, SLOW_DELAY_US, True)
    goods, bads = comm.allgather(good), comm.allgather(bad)
    checks.check(all(goods), f"{name} direct: wrong results with the waits: {goods}")
    checks.check(not all(bads), f"{name} direct: the ordering test cannot fail")


@pytest.mark.parametrize("name", ["send-recv", "send-recv-any"])
def test_send_recv_staged_until_agreed(name, direct_settings, request, comm, checks):
    """send and recv, which the other ranks do not join, stay staged in direct mode until the
    communicator's ranks have agreed on the GPU path (a collective's first GPU call); then
    they go direct."""
    case = case_of(name, request, comm)
    for agreed in (False, True):
        if agreed:
            agree()
        start_counting()
        x, out = on_device(case, FakeCudaArray, Stream(), DELAY_US)
        ret = case.call(x, out)
        mine, fake, log = counted()
        what = f"{name} {'after' if agreed else 'before'} the agreement, rank {comm.rank}"
        check_outcome(case, x, out, ret, what, checks.check)
        check_copies([] if agreed else case.copies, mine, fake, log, what, checks.check)
        checks.check((mine["direct_calls"], mine["staged_calls"]) == ((2, 0) if agreed else (0, 2)),
                     f"{what}: path counts {mine}")


# --- managed memory: MPI reads it on the host, no copies -----------------------------------
@pytest.mark.parametrize("name", CALLS)
def test_managed_memory(name, request, comm, checks):
    """Managed memory: after the wait for the producer's stream (the delayed kernel's input
    is what is sent), MPI on the memory itself: no copies, no path choice."""
    case = case_of(name, request, comm)
    start_counting()
    x, out = on_device(case, FakeCudaArray, Stream(), DELAY_US,
                       device_type=fakecuda.KDL_CUDA_MANAGED)
    ret = case.call(x, out)
    mine, fake, log = counted()
    what = f"{name} managed, rank {comm.rank}"
    check_outcome(case, x, out, ret, what, checks.check)
    check_copies([], mine, fake, log, what, checks.check)
    checks.check(mine["direct_calls"] == mine["staged_calls"] == fake["host_allocs"] == 0,
                 f"{what}: counted {mine}, fake host_allocs {fake['host_allocs']}")


# --- pinned staging memory reused ------------------------------------------------------------
def test_pinned_memory_reused(request, comm, checks):
    """Every call a second time, each of a size staged before: no pinned allocation. A call
    larger than all the pinned memory held grows it once, and not again when repeated."""
    check = checks.check
    names = [n for n in CALLS if comm.size > 1 or not n.startswith("send")]
    for round_ in (0, 1):
        for name in names:
            case = case_of(name, request, comm, round_)
            x, out = on_device(case, FakeCudaArray, Stream(), 0)
            start_counting()
            case.call(x, out)
            mine, fake, _ = counted()
            check(result_ok(case, x, out), f"{name} round {round_}: result")
            if round_:
                check(mine["pinned_allocs"] == fake["host_allocs"] == 0,
                      f"{name} repeated: pinned memory allocated: counted {mine}, fake "
                      f"host_allocs {fake['host_allocs']}")
    # an allgather needing more pinned memory than any rank holds now (the cases before this
    # one in the session may have grown it, by different amounts on different ranks: the
    # count must be the same on every rank)
    held = comm.allreduce(_cuda.copy_counts()["pinned_bytes"], op=MPI.MAX)
    n = held // ((comm.size + 1) * ITEM) + 1000
    salt = zlib.crc32(request.node.nodeid.encode()) % 1009
    mine_x = values(n, comm.rank, salt)
    want = np.concatenate([values(n, r, salt) for r in range(comm.size)])
    for round_ in (0, 1):
        x = FakeCudaArray.from_numpy(mine_x)
        out = FakeCudaArray.from_numpy(blank(comm.size * n))
        start_counting()
        fastreduce.allgather(x, out=out)
        mine, fake, _ = counted()
        check(same(out.to_numpy(), want), f"large allgather round {round_}: result")
        grown = 1 - round_
        check(mine["pinned_allocs"] == fake["host_allocs"] == grown,
              f"large allgather of {n} elements round {round_}: {grown} pinned allocation "
              f"expected: counted {mine}, fake host_allocs {fake['host_allocs']}")


# --- bad input: refused before any MPI call --------------------------------------------------
def bad_calls(rank: int, size: int):
    """(words of the message, fn, tensors that must not change) for each bad combination of
    devices; gather's and scatter's root is this rank (they never reach MPI)."""
    x = FakeCudaArray.from_numpy(values(4, rank, 1))
    xs = FakeCudaArray.from_numpy(values(4, rank, 2))
    h = np.ones(4, np.float32)
    h4 = np.ones(4, np.float32)
    managed = FakeCudaArray.from_numpy(values(4, rank, 3), device_type=fakecuda.KDL_CUDA_MANAGED)
    other = FakeCudaArray.from_numpy(values(4, rank, 4), device=1)
    hx, gx = np.ones(4 * size, np.float32), FakeCudaArray.from_numpy(values(4 * size, rank, 5))
    hout, gout = np.ones(4 * size, np.float32), FakeCudaArray.from_numpy(blank(4 * size))
    counts = [4] * size
    device_x = ["out is on cpu", "the input on cuda:0"]
    host_x = ["out is on cuda:0", "the input on cpu"]
    return [
        (["allgather", *device_x], lambda: fastreduce.allgather(x, out=hout), [x, hout]),
        (["allgather", *host_x], lambda: fastreduce.allgather(h, out=gout), [h, gout]),
        (["allgather", *device_x], lambda: fastreduce.allgather(x, out=hout, counts=counts),
         [x, hout]),
        (["allgather", "out is on cuda (managed):0", "the input on cuda:0"],
         lambda: fastreduce.allgather(x, out=FakeCudaArray.from_numpy(
             blank(4 * size), device_type=fakecuda.KDL_CUDA_MANAGED)), [x]),
        (["allgather", "out is on cuda:0", "the input on cuda (managed):0"],
         lambda: fastreduce.allgather(managed, out=gout), [managed, gout]),
        (["out is on cuda:1", "current CUDA device is cuda:0"],
         lambda: fastreduce.allgather(x, out=FakeCudaArray.from_numpy(
             blank(4 * size), device=1)), [x]),
        (["x is on cuda:1", "current CUDA device is cuda:0"],
         lambda: fastreduce.allgather(other, out=gout), [other, gout]),
        (["reduce_scatter", *device_x], lambda: fastreduce.reduce_scatter(gx, out=h4),
         [gx, h4]),
        (["reduce_scatter", *host_x], lambda: fastreduce.reduce_scatter(hx, out=xs), [hx, xs]),
        (["reduce_scatter", *device_x],
         lambda: fastreduce.reduce_scatter(gx, out=h4, counts=counts), [gx, h4]),
        (["alltoall", *device_x], lambda: fastreduce.alltoall(gx, out=hout), [gx, hout]),
        (["alltoall", *host_x], lambda: fastreduce.alltoall(hx, out=gout), [hx, gout]),
        (["alltoall", *device_x],
         lambda: fastreduce.alltoall(gx, out=hout, send_counts=[4] * size,
                                     recv_counts=[4] * size), [gx, hout]),
        (["gather", *device_x], lambda: fastreduce.gather(x, rank, out=hout), [x, hout]),
        (["gather", *host_x], lambda: fastreduce.gather(h, rank, out=gout), [h, gout]),
        (["scatter", *device_x], lambda: fastreduce.scatter(gx, rank, out=h4), [gx, h4]),
        (["scatter", *host_x], lambda: fastreduce.scatter(hx, rank, out=xs), [hx, xs]),
        (["x is on cuda:1", "current CUDA device is cuda:0"],
         lambda: fastreduce.broadcast_(other, 0), [other]),
        (["x is on cuda:1", "current CUDA device is cuda:0"],
         lambda: fastreduce.reduce_(other, "sum", 0), [other]),
    ]


def test_bad_devices_refused(comm, checks):
    """x in device memory and out on the host, or the reverse, managed with device memory,
    another device: ValueError naming both, nothing changed, nothing copied or waited for,
    no GPU path chosen (its first call on a communicator is a collective)."""
    fastreduce.broadcast_(np.zeros(1, np.float32), 0)  # the default communicator made
    calls = bad_calls(comm.rank, comm.size)
    start_counting()
    for words, fn, unchanged in calls:
        checks.expect(ValueError, words, fn, *unchanged)
    mine, fake, log = counted()
    checks.check(log == [] and all(mine[k] == 0 for k in (
        "d2h_copies", "h2d_copies", "stream_syncs", "event_syncs", "pinned_allocs",
        "direct_calls", "staged_calls")), f"refused calls did work: {mine}, {log}")
    checks.check(fake["stream_syncs"] == fake["event_syncs"] == fake["host_allocs"] == 0,
                 f"refused calls did work: fake {fake}")


@pytest.mark.timeout(60)
def test_bad_devices_refused_on_one_rank_alone(direct_settings, comm, checks):
    """Rank 0 alone makes the bad calls, in direct mode before the ranks have agreed on the
    GPU path (an agreement is a collective): had any of them reached an MPI call that
    communicates, rank 0 would wait for ever (and the case time out)."""
    if comm.size == 1:
        pytest.skip("needs a rank that makes no call")
    fastreduce.broadcast_(np.zeros(1, np.float32), 0)  # the default communicator made
    if comm.rank == 0:
        for words, fn, unchanged in bad_calls(comm.rank, comm.size):
            checks.expect(ValueError, words, fn, *unchanged)
    comm.Barrier()
