"""iallreduce / iallreduce_ / wait_all against the blocking calls; Request lifetime
(dropped requests, freed communicators); allreduce_coalesced_."""

from __future__ import annotations

import gc
import zlib

import numpy as np
import pytest
import torch
from fake_dlpack import FakeTensor
from mpi4py import MPI

import fastreduce

pytestmark = [pytest.mark.mpi(ranks=(1, 2, 3, 4)), pytest.mark.across_nodes]


def rand(seed, *shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 8).round().to(dtype)  # integer-valued: exact


def _forms() -> list:
    """(dtype, op, shape) with ids like float32-sum-3x50000."""
    params = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.complex64):
        ops = ["sum", "max"] if not dtype.is_complex else ["sum", "avg"]
        if dtype.is_floating_point:
            ops.append("avg")
        for op in ops:
            for shape in [(), (0,), (7,), (3, 50_000)]:
                name = "x".join(map(str, shape)) or "scalar"
                params.append(pytest.param(dtype, op, shape,
                                           id=f"{str(dtype).split('.')[-1]}-{op}-{name}"))
    return params


@pytest.fixture
def count_limit(request):
    """The int-count limit lowered to the case's parameter, restored after."""
    old = fastreduce.backend.reduce._set_count_limit(request.param)
    yield request.param
    fastreduce.backend.reduce._set_count_limit(old)


@pytest.mark.parametrize("dtype, op, shape", _forms())
def test_every_form_matches_blocking(dtype, op, shape, checks, comm):
    """iallreduce, iallreduce(out=) and iallreduce_ give allreduce's result; waiting twice
    is harmless."""
    x = rand(zlib.crc32(repr((dtype, op, shape)).encode()) + comm.rank, *shape, dtype=dtype)
    want = fastreduce.allreduce(x, op)
    keep = x.clone()
    got = fastreduce.iallreduce(x, op).wait()
    checks.check(torch.equal(got, want) and torch.equal(x, keep),
                 f"iallreduce {dtype} {op} {shape}")
    out = torch.empty_like(x)
    req = fastreduce.iallreduce(x, op, out=out)
    checks.check(req.wait() is out and torch.equal(out, want), f"out= {dtype} {op}")
    y = x.clone()
    req = fastreduce.iallreduce_(y, op)
    checks.check(req.wait() is y and torch.equal(y, want), f"iallreduce_ {dtype} {op}")
    checks.check(req.done and req.wait() is y and torch.equal(y, want), "wait twice")


def test_test_never_blocks(checks, comm):
    """test() never blocks: a rank that starts late keeps the others' test() False; polling
    with test() ends."""
    p, rank = comm.size, comm.rank
    late = fastreduce.iallreduce(torch.ones(2)) if rank == 0 else None
    if rank == 0:
        checks.check(p == 1 or not late.test(), "test() reported done before every rank started")
    comm.Barrier()
    if rank != 0:
        late = fastreduce.iallreduce(torch.ones(2))
    checks.check(torch.equal(late.wait(), torch.full((2,), float(p))), "late start")
    polled = fastreduce.iallreduce(torch.ones(3))
    while not polled.test():
        pass
    checks.check(torch.equal(polled.wait(), torch.full((3,), float(p))), "polling with test()")


def test_wait_all(checks, comm):
    """wait_all over many, including numpy and already-completed ones."""
    p, rank = comm.size, comm.rank
    xs = [rand(10 + i + rank, 5 + i) for i in range(6)]
    reqs = [fastreduce.iallreduce(x) for x in xs]
    reqs[2].wait()
    arr = np.full(4, rank + 1.0)
    reqs.append(fastreduce.iallreduce_(arr))
    results = fastreduce.wait_all(reqs)
    checks.check(all(torch.equal(r, fastreduce.allreduce(x))
                     for r, x in zip(results, xs, strict=False)), "wait_all results")
    checks.check(results[-1] is arr and np.array_equal(arr, np.full(4, p * (p + 1) / 2)),
                 "numpy")


@pytest.mark.parametrize("count_limit", [pytest.param(7, id="limit7")], indirect=True)
def test_counts_over_the_int_limit(count_limit, checks, comm):
    """Counts over the int limit: chunked or large-count requests."""
    x = rand(99 + comm.rank, 100)
    checks.check(torch.equal(fastreduce.iallreduce(x, "avg").wait(),
                             fastreduce.allreduce(x, "avg")), "chunked iallreduce avg")
    h = rand(5 + comm.rank, 33, dtype=torch.bfloat16)
    checks.check(torch.equal(fastreduce.iallreduce(h).wait(), fastreduce.allreduce(h)),
                 "chunked bf16")


def test_dropped_requests(checks, comm):
    """Dropped without wait: completed at garbage collection, buffers intact meanwhile."""
    for i in range(20):
        fastreduce.iallreduce(torch.ones(1000) * i)
        fastreduce.iallreduce_(torch.ones(10))
    gc.collect()
    checks.check(torch.equal(fastreduce.allreduce(torch.ones(2)),
                             torch.full((2,), float(comm.size))),
                 "communicator in step after dropped requests")


def test_wait_after_free(checks, comm):
    """Freeing a communicator after its request completed: waiting again is harmless."""
    dup = comm.Dup()
    req = fastreduce.iallreduce(torch.ones(4), comm=dup)
    req.wait()
    dup.Free()
    checks.check(torch.equal(req.wait(), torch.full((4,), float(comm.size))), "wait after Free")


@pytest.mark.parametrize("size", [4, 1 << 20], ids=["mpi-request", "engine"])
def test_freed_while_pending(checks, comm, size):
    """A communicator freed with a request pending (every rank frees it): the request is
    completed as it goes, so wait() returns the result, and the next call on another
    communicator works (Open MPI 5 crashed there: its request was left on a freed
    communicator). Small: an MPI_Iallreduce; large: a job of the progress engine."""
    dup = comm.Dup()
    x = torch.ones(size)
    req = fastreduce.iallreduce(x, comm=dup)
    dup.Free()
    checks.check(torch.equal(req.wait(), torch.full((size,), float(comm.size))),
                 "the request completed when its communicator was freed")
    y = torch.ones(3)
    fastreduce.allreduce_(y)
    checks.check(torch.equal(y, torch.full((3,), float(comm.size))), "the next call")


def test_freed_through_another_handle(checks, comm):
    """A communicator freed through one mpi4py object and reached through another of the
    same handle (MPI.Comm(c)): refused, not a crash; a new communicator that reuses the
    handle works."""
    c = comm.Dup()
    y = torch.ones(3)
    fastreduce.allreduce_(y, comm=c)
    alias = MPI.Comm(c)
    c.Free()
    if fastreduce.build_mpi()[0] == "MPICH":  # its handles are table indices: MPI says so
        checks.expect(Exception, [], lambda: fastreduce.allreduce_(torch.ones(3), comm=alias))
    else:
        checks.expect(ValueError, ["comm was freed", "MPI.Comm(c)"],
                      lambda: fastreduce.allreduce_(torch.ones(3), comm=alias))
    fresh = [comm.Dup() for _ in range(4)]  # one may reuse the freed handle
    for d in fresh:
        z = torch.ones(2)
        fastreduce.allreduce_(z, comm=d)
        checks.check(torch.equal(z, torch.full((2,), float(comm.size))), "a new communicator")
        d.Free()


def test_bad_input_starts_nothing(checks):
    """Bad input raises before starting anything."""
    checks.expect(BufferError, ["not contiguous"],
                  lambda: fastreduce.iallreduce_(torch.ones(4, 4).T))
    checks.expect(TypeError, ["Requests"], lambda: fastreduce.wait_all([1]))


# --- coalesced -----------------------------------------------------------------------------

def test_coalesced_sum(checks, comm):
    """allreduce_coalesced_ over mixed dtypes and shapes: the tensors themselves, reduced
    as allreduce reduces each."""
    dtypes = [torch.float32, torch.float64, torch.int64, torch.float16, torch.float32]
    shapes = [(3,), (0,), (2, 5), (1,), (1000,), (), (0, 4), (17,)]
    tensors = [rand(200 + i + comm.rank * 31, *shapes[i % len(shapes)],
                    dtype=dtypes[i % len(dtypes)]) for i in range(40)]
    wanted = [fastreduce.allreduce(t) for t in tensors]
    same = fastreduce.allreduce_coalesced_(tensors)
    checks.check(same is not None and all(a is b for a, b in zip(same, tensors, strict=True)),
                 "returns the tensors")
    checks.check(all(torch.equal(t, w) for t, w in zip(tensors, wanted, strict=True)),
                 "coalesced sum over mixed dtypes and shapes")


def test_coalesced_avg(checks, comm):
    avg_in = [rand(7 + comm.rank, 9), rand(8 + comm.rank, 2, dtype=torch.float64)]
    avg_want = [fastreduce.allreduce(t, "avg") for t in avg_in]
    fastreduce.allreduce_coalesced_(avg_in, "avg")
    checks.check(all(torch.equal(t, w) for t, w in zip(avg_in, avg_want, strict=True)), "avg")


def test_coalesced_empty_list(checks):
    checks.check(fastreduce.allreduce_coalesced_([]) == [], "empty list")


def test_coalesced_bad_input(checks):
    """A bad tensor anywhere in the list: a clear error, nothing changed."""
    bad = [torch.ones(3), torch.ones(3, 3).T]
    before = [t.clone() for t in bad]
    checks.expect(BufferError, ["tensors[1]", "not contiguous"],
                  lambda: fastreduce.allreduce_coalesced_(bad))
    checks.check(all(torch.equal(a, b) for a, b in zip(bad, before, strict=True)),
                 "nothing changed")
    checks.expect(ValueError, ["'avg'", "int64"],
                  lambda: fastreduce.allreduce_coalesced_(
                      [torch.ones(2), torch.ones(2, dtype=torch.int64)], "avg"))
    host = np.ones(3, np.float32)
    checks.expect(ValueError,
                  ["tensors[1] is on cpu (CUDA pinned)", "tensors[0] on cpu", "one device"],
                  lambda: fastreduce.allreduce_coalesced_([np.ones(3, np.float32),
                                                           FakeTensor(host, device=(3, 0))]))
