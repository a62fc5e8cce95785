"""fastreduce.horovod's set-up, collectives, handles, autograd, process sets, join, timeline
and errors, against references computed here from every rank's inputs (each rank can make
every rank's input).

Horovod's state is process-wide: the `horovod` fixture calls hvd.init() once for this
module and hvd.shutdown() after its last case, so that other modules of the session start
from no Horovod world. The cases that ran after the old script's `hvd.init(process_sets=
"dynamic")` (process sets, join, timeline, errors, restart) ask for `dynamic_sets`, which
starts Horovod again that way for the one case.

Every case is marked across_nodes: the passes across nodes run them again.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from mpi4py import MPI

import fastreduce
import fastreduce.horovod as hvd

pytestmark = pytest.mark.across_nodes

WORLD = MPI.COMM_WORLD
rank, size = WORLD.rank, WORLD.size
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
OPS = {"Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product,
       "Average": hvd.Average}
MORE_THAN_ONE = pytest.mark.mpi(ranks=(2, 3, 4))  # on one rank every set is the global one


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make(r: int, shape, dtype, salt: int = 0):
    """Rank r's input: small integers (exact in every dtype, products of up to 4 included)."""
    g = torch.Generator().manual_seed(1000 * r + salt)
    low = 0 if dtype == torch.uint8 else -2
    return torch.randint(low, 3, shape, generator=g).to(dtype)


def everyone(shape, dtype, salt=0):
    return torch.stack([make(r, shape, dtype, salt).to(torch.float64) for r in range(size)])


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture(scope="module", autouse=True)
def horovod():
    """hvd.init() for this module's cases, hvd.shutdown() after the last one."""
    assert not hvd.is_initialized(), "a module before this one left Horovod initialized"
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def dynamic_sets(horovod):
    """Horovod started again with hvd.init(process_sets="dynamic") for one case; after it,
    as the module's fixture started it."""
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    yield
    hvd.shutdown()
    hvd.init()


# --- set-up --------------------------------------------------------------------------------
def test_basics(checks, comm):
    """Rank, size and the node topology against fastreduce's; what is built."""
    checks.check(hvd.is_initialized(), "is_initialized")
    checks.check((hvd.rank(), hvd.size()) == (WORLD.rank, WORLD.size),
                 f"rank/size {hvd.rank()}/{hvd.size()}")
    checks.check(hvd.local_rank() == fastreduce.local_rank(), "local_rank")
    checks.check(hvd.local_size() == fastreduce.local_size(), "local_size")
    # Every rank's (local rank, local size): on one host, or the same number of ranks on
    # each node, the nodes are size // local_size and the placement is homogeneous; across
    # nodes with 3 ranks on 2 nodes (2 + 1) neither holds, and the cross communicator of
    # local rank k has as many ranks as there are nodes with a local rank k.
    placement = comm.allgather((fastreduce.local_rank(), fastreduce.local_size()))
    nodes = sum(1 for local_rank, _ in placement if local_rank == 0)
    crossing = sum(1 for local_rank, _ in placement if local_rank == hvd.local_rank())
    homogeneous = len({local_size for _, local_size in placement}) == 1
    checks.check(hvd.cross_size() == crossing and 0 <= hvd.cross_rank() < crossing,
                 f"cross {hvd.cross_rank()}/{hvd.cross_size()} on {nodes} nodes")
    checks.check(hvd.is_homogeneous() == homogeneous, f"is_homogeneous (placement {placement})")
    checks.check(hvd.mpi_enabled() and hvd.mpi_built() and not hvd.nccl_built()
                 and not hvd.gloo_enabled() and not hvd.ddl_built() and not hvd.ccl_built(),
                 "what is built")
    checks.check(hvd.mpi_threads_supported() in (True, False), "mpi_threads_supported")
    checks.check(hvd.global_process_set.size() == size and
                 hvd.global_process_set.rank() == rank, "global process set")


# --- allreduce -----------------------------------------------------------------------------
@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=dtype_id)
def test_allreduce(checks, dtype, op_name):
    """Every shape of one dtype and op against the reduction of every rank's input."""
    op = OPS[op_name]
    ops = {hvd.Sum: lambda s: s.sum(0), hvd.Min: lambda s: s.min(0).values,
           hvd.Max: lambda s: s.max(0).values, hvd.Product: lambda s: s.prod(0),
           hvd.Average: lambda s: s.sum(0) / size}
    for shape in [(), (17,), (3, 4, 5)]:
        x = make(rank, shape, dtype, op)
        before = x.clone()
        got = hvd.allreduce(x, op=op)
        want = ops[op](everyone(shape, dtype, op))
        if op == hvd.Average and not dtype.is_floating_point:
            want = want.trunc()
        tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
        ok = got.dtype == dtype and got.shape == x.shape and \
            torch.allclose(got.to(torch.float64), want, rtol=tol, atol=tol)
        checks.check(ok, f"allreduce {dtype} {shape} op {op}: {got} != {want}")
        checks.check(same(x, before), "allreduce modified its input")


def test_scale_factors(checks):
    x = make(rank, (6,), torch.float32, 7)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    checks.check(torch.equal(got, (everyone((6,), torch.float32, 7).sum(0) / 2).float()),
                 "prescale/postscale")
    got = hvd.allreduce(x, average=False)
    checks.check(torch.equal(got, everyone((6,), torch.float32, 7).sum(0).float()),
                 "average=False")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int32], ids=dtype_id)
def test_average_with_factors(checks, dtype):
    """Average with factors: the float path divides in fastreduce, the integer one in torch."""
    v = make(rank, (5,), dtype, 12)
    got = hvd.allreduce(v, prescale_factor=3.0, postscale_factor=0.5)
    want = everyone((5,), dtype, 12).mul(3.0).sum(0) / size * 0.5
    want = want.to(dtype) if dtype.is_floating_point else \
        (everyone((5,), dtype, 12).mul(3.0).trunc().sum(0) * (0.5 / size)).trunc().to(dtype)
    checks.check(got.dtype == dtype and torch.allclose(got.double(), want.double(), rtol=1e-6),
                 f"Average with factors {dtype}: {got} != {want}")


def test_async_in_place_average(checks):
    a = make(rank, (7,), torch.float32, 13)
    handle = hvd.allreduce_async_(a, name="async average")
    checks.check(hvd.synchronize(handle) is a and
                 torch.allclose(a.double(), everyone((7,), torch.float32, 13).mean(0),
                                rtol=1e-6), f"async in-place Average {a}")


def test_allreduce_in_place(checks):
    y = make(rank, (6,), torch.float32, 7)
    out = hvd.allreduce_(y, op=hvd.Max, name="in.place")
    checks.check(out is y and
                 torch.equal(y, everyone((6,), torch.float32, 7).max(0).values.float()),
                 "allreduce_ in place")


def test_async_poll(checks):
    z = make(rank, (1000,), torch.float64, 8)
    handle = hvd.allreduce_async_(z, op=hvd.Sum, name="async")
    while not hvd.poll(handle):
        pass
    checks.check(hvd.synchronize(handle) is z and
                 torch.equal(z, everyone((1000,), torch.float64, 8).sum(0)), "async")
    h2 = hvd.allreduce_async(make(rank, (5,), torch.int32, 9), op=hvd.Sum)
    checks.check(torch.equal(hvd.synchronize(h2), everyone((5,), torch.int32, 9).sum(0).int()),
                 "allreduce_async")


@pytest.mark.parametrize("kind", ["allgather", "broadcast", "alltoall", "reducescatter",
                                  "grouped_allgather"])
def test_async_collectives_run_in_the_background(checks, kind):
    """The _async forms of the collectives other than allreduce are not done when they
    return: with the progress engine held busy, poll() is False until it is let go; then
    synchronize() gives the result."""
    from fastreduce.backend import engine

    if not engine.state()[0]:
        pytest.skip(f"the progress engine is off here: {engine.state()[1]}")
    x = make(rank, (size * 2, 3), torch.float64, 12)
    start = {
        "allgather": lambda: hvd.allgather_async(x),
        "broadcast": lambda: hvd.broadcast_async(x, 0),
        "alltoall": lambda: hvd.alltoall_async(x),
        "reducescatter": lambda: hvd.reducescatter_async(x, op=hvd.Sum),
        "grouped_allgather": lambda: hvd.grouped_allgather_async([x, x[:1]]),
    }[kind]
    want = {
        "allgather": lambda xs: torch.cat(xs),
        "broadcast": lambda xs: xs[0],
        "alltoall": lambda xs: torch.cat([t[2 * rank:2 * rank + 2] for t in xs]),
        "reducescatter": lambda xs: sum(xs)[2 * rank:2 * rank + 2],
        "grouped_allgather": lambda xs: [torch.cat(xs), torch.cat([t[:1] for t in xs])],
    }[kind](list(everyone((size * 2, 3), torch.float64, 12)))
    release = threading.Event()
    busy = engine.submit_call(release.wait)  # the engine's thread waits for us
    try:
        handle = start()
        checks.check(not hvd.poll(handle), f"{kind}_async was done while the engine was busy")
    finally:
        release.set()
    engine.wait_job(busy)
    got = hvd.synchronize(handle)
    if kind == "alltoall":  # (rows received, received splits)
        got, splits = got
        checks.check(splits.tolist() == [2] * size, f"alltoall_async splits {splits}")
    equal = all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) \
        if isinstance(want, list) else torch.equal(got, want)
    checks.check(equal, f"{kind}_async gave {got}")


def test_blocking_with_async(checks):
    """One rank waits at once, the others later: the same collective for MPI."""
    w = make(rank, (3,), torch.float64, 11)
    got = hvd.allreduce(w, op=hvd.Sum, name="mixed") if rank == 0 else \
        hvd.synchronize(hvd.allreduce_async(w, op=hvd.Sum, name="mixed"))
    checks.check(torch.equal(got, everyone((3,), torch.float64, 11).sum(0)),
                 "blocking with async")


def test_fp16_compression(checks):
    checks.check(torch.equal(hvd.allreduce(make(rank, (4,), torch.float32, 10),
                                           compression=hvd.Compression.fp16, op=hvd.Sum),
                             everyone((4,), torch.float32, 10).sum(0).float()),
                 "Compression.fp16")


# --- grouped -------------------------------------------------------------------------------
def test_grouped_allreduce(checks):
    dtypes = [torch.float32, torch.int64, torch.float32, torch.float16]
    shapes = [(3,), (2, 2), (5,), (4,)]
    xs = [make(rank, s, d, 20 + i) for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]
    wants = [everyone(s, d, 20 + i).sum(0).to(d) for i, (s, d) in
             enumerate(zip(shapes, dtypes, strict=True))]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    checks.check(all(same(o, w) for o, w in zip(outs, wants, strict=True)), "grouped_allreduce")
    handle = hvd.grouped_allreduce_async_(xs, op=hvd.Sum)
    got = hvd.synchronize(handle)
    checks.check(all(o is x for o, x in zip(got, xs, strict=True)) and
                 all(same(x, w) for x, w in zip(xs, wants, strict=True)),
                 "grouped_allreduce_async_")


def test_grouped_average(checks):
    ys = [make(rank, (3,), torch.float64, 30), make(rank, (2,), torch.float64, 31)]
    avg = hvd.grouped_allreduce(ys)  # Average by default
    checks.check(all(torch.allclose(a, everyone(y.shape, torch.float64, 30 + i).mean(0))
                     for i, (a, y) in enumerate(zip(avg, ys, strict=True))), "grouped average")
    mixed = [make(rank, (4,), torch.float32, 32), make(rank, (3,), torch.int64, 33)]
    got = hvd.grouped_allreduce(mixed)  # Average of a float and an integer tensor
    checks.check(torch.allclose(got[0].double(), everyone((4,), torch.float32, 32).mean(0),
                                rtol=1e-6) and
                 torch.equal(got[1], everyone((3,), torch.int64, 33).mean(0).trunc().long()),
                 f"grouped average of float and int {got}")


def test_grouped_allgather(checks):
    gathered = hvd.grouped_allgather([torch.full((rank + 1,), rank), torch.ones(1, 2) * rank])
    checks.check(gathered[0].tolist() == [r for r in range(size) for _ in range(r + 1)] and
                 gathered[1].shape == (size, 2), "grouped_allgather")


# --- data movement -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool,
                                   torch.complex64], ids=dtype_id)
def test_allgather_and_broadcast(checks, dtype):
    """allgather of a different number of rows on each rank; broadcast(_) from every root."""
    x = (torch.arange((rank + 1) * 3).reshape(rank + 1, 3) + 10 * rank).to(dtype)
    got = hvd.allgather(x)
    want = torch.cat([(torch.arange((r + 1) * 3).reshape(r + 1, 3) + 10 * r).to(dtype)
                      for r in range(size)])
    checks.check(same(got, want), f"allgather {dtype}")
    for root in range(size):
        t = make(rank, (2, 3), torch.float64, 40).to(dtype)
        before = t.clone()
        got = hvd.broadcast(t, root)
        checks.check(same(got, make(root, (2, 3), torch.float64, 40).to(dtype)) and
                     same(t, before), f"broadcast {dtype} from {root}")
        hvd.broadcast_(t, root)
        checks.check(same(t, got), f"broadcast_ {dtype} from {root}")


def test_allgather_async(checks):
    h = hvd.allgather_async(torch.tensor([rank]))
    checks.check(hvd.synchronize(h).tolist() == list(range(size)), "allgather_async")


def test_alltoall(checks):
    # rank r sends (r + d + 1) rows to rank d, row values 100 r + d
    splits = [rank + d + 1 for d in range(size)]
    rows = torch.cat([torch.full((n, 2), 100 * rank + d) for d, n in enumerate(splits)])
    out, received = hvd.alltoall(rows, splits=splits)
    want = torch.cat([torch.full((r + rank + 1, 2), 100 * r + rank) for r in range(size)])
    checks.check(same(out, want) and received.tolist() == [r + rank + 1 for r in range(size)],
                 f"alltoall with splits {out} {received}")
    even = torch.arange(size * 2) + 1000 * rank
    got = hvd.alltoall(even)
    checks.check(got.tolist() == [1000 * r + 2 * rank + k for r in range(size)
                                  for k in range(2)], f"alltoall equal {got}")


def test_reducescatter(checks):
    # rows split as equally as may be, the first rows % size ranks one more
    n = 2 * size + 1
    x = make(rank, (n, 3), torch.float64, 50)
    mine = [n // size + (1 if r < n % size else 0) for r in range(size)]
    start = sum(mine[:rank])
    total = everyone((n, 3), torch.float64, 50).sum(0)
    got = hvd.reducescatter(x, op=hvd.Sum)
    checks.check(torch.equal(got, total[start:start + mine[rank]]), "reducescatter Sum")
    got = hvd.reducescatter(x)  # Average by default
    checks.check(torch.allclose(got, total[start:start + mine[rank]] / size),
                 "reducescatter Average")
    outs = hvd.grouped_reducescatter([x, x * 2], op=hvd.Sum)
    checks.check(torch.equal(outs[1], 2 * total[start:start + mine[rank]]),
                 "grouped_reducescatter")
    hvd.barrier()


def test_sparse(checks):
    i = torch.tensor([[rank % 3, 2], [0, rank % 2]])
    v = torch.tensor([1.0 + rank, 2.0])
    t = torch.sparse_coo_tensor(i, v, (3, 2), check_invariants=True)
    got = hvd.sparse_allreduce_async(t, "sparse", hvd.Sum)()  # Horovod's handle: a callable
    want = sum(torch.sparse_coo_tensor(torch.tensor([[r % 3, 2], [0, r % 2]]),
                                       torch.tensor([1.0 + r, 2.0]), (3, 2),
                                       check_invariants=True).to_dense()
               for r in range(size))
    checks.check(got.is_sparse and torch.equal(got.to_dense(), want), f"sparse {got}")


# --- autograd ------------------------------------------------------------------------------
def upstream():
    """Each rank's upstream gradient."""
    return [make(r, (4,), torch.float64, 60) for r in range(size)]


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_allreduce_grad(checks, op_name):
    op, w = OPS[op_name], upstream()
    want = sum(w) if op == hvd.Sum else sum(w) / size
    x = make(rank, (4,), torch.float64, 61).requires_grad_()
    (hvd.allreduce(x, op=op) * w[rank]).sum().backward()
    checks.check(torch.allclose(x.grad, want), f"allreduce grad op {op}")


def test_allgather_grad(checks):
    """Rank r contributes r + 1 rows; its gradient is the average over ranks of the
    upstream gradient's slice for those rows (Horovod's definition)."""
    x = torch.ones(rank + 1, 2, dtype=torch.float64, requires_grad=True)
    rows = sum(r + 1 for r in range(size))
    ups = [make(r, (rows, 2), torch.float64, 62) for r in range(size)]
    (hvd.allgather(x) * ups[rank]).sum().backward()
    start = sum(r + 1 for r in range(rank))
    checks.check(torch.allclose(x.grad, (sum(ups) / size)[start:start + rank + 1]),
                 "allgather grad")


def test_broadcast_grad(checks):
    w = upstream()
    x = make(rank, (3,), torch.float64, 63).requires_grad_()
    (hvd.broadcast(x, 0) * w[rank][:3]).sum().backward()
    want = sum(w)[:3] / size if rank == 0 else torch.zeros(3, dtype=torch.float64)
    checks.check(torch.allclose(x.grad, want), "broadcast grad")


def test_alltoall_grad(checks):
    x = make(rank, (size * 2, 2), torch.float64, 64).requires_grad_()
    out = hvd.alltoall(x)
    ups = [make(r, (size * 2, 2), torch.float64, 65) for r in range(size)]
    (out * ups[rank]).sum().backward()
    # x's rows 2d, 2d+1 went to rank d, where they are rows 2 rank, 2 rank + 1
    want = torch.cat([ups[d][2 * rank:2 * rank + 2] for d in range(size)])
    checks.check(torch.equal(x.grad, want), "alltoall grad")


@pytest.mark.parametrize(("op", "prescale", "postscale"), [
    (hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 2.0, 0.5), (hvd.Average, 3.0, 2.0)],
    ids=["sum", "average", "sum-scaled", "average-scaled"])
def test_reducescatter_grad(checks, op, prescale, postscale):
    """Horovod's gradient of a reduce-scatter: every rank's incoming gradient gathered,
    times the set's size for Sum (Average: not divided), times both scale factors."""
    x = make(rank, (size, 2), torch.float64, 66).requires_grad_()
    ups = [make(r, (1, 2), torch.float64, 67) for r in range(size)]
    (hvd.reducescatter(x, op=op, prescale_factor=prescale, postscale_factor=postscale)
     * ups[rank]).sum().backward()
    factor = (size if op == hvd.Sum else 1) * prescale * postscale
    checks.check(torch.allclose(x.grad, torch.cat(ups) * factor), f"reducescatter grad {x.grad}")


def test_grouped_allreduce_grad(checks):
    w = upstream()
    xs = [make(rank, (2,), torch.float64, 68).requires_grad_() for _ in range(2)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    (outs[0] * w[rank][:2] + outs[1] * 2 * w[rank][:2]).sum().backward()
    checks.check(torch.allclose(xs[0].grad, sum(w)[:2]) and
                 torch.allclose(xs[1].grad, 2 * sum(w)[:2]), "grouped_allreduce grad")


# --- matching by name ----------------------------------------------------------------------

def _named_call(n: str, i: int):
    """Submit request n (kind by i) of this rank's input; (handle, the expected result)."""
    x = make(rank, (2 * size, 3), torch.float64, 20 + i)
    xs = list(everyone((2 * size, 3), torch.float64, 20 + i))
    if i % 3 == 0:
        return hvd.allreduce_async(x, op=hvd.Sum, name=n), sum(xs)
    if i % 3 == 1:
        return hvd.allgather_async(x, name=n), torch.cat(xs)
    return hvd.broadcast_async(x, size - 1, name=n), xs[size - 1]


@MORE_THAN_ONE
def test_named_requests_in_different_orders_complete(checks):
    """The ranks submit the same named requests each in its own order (rotated by rank, the
    last rank's reversed) and synchronize them in yet another: each one runs, right, on
    every rank (Horovod matches requests by name, not by order)."""
    names = [f"order.{i}" for i in range(6)]
    mine = names[::-1] if rank == size - 1 else names[rank:] + names[:rank]
    submitted = {n: _named_call(n, int(n.split(".")[1])) for n in mine}
    for n in sorted(submitted, reverse=True):
        handle, want = submitted[n]
        got = hvd.synchronize(handle)
        checks.check(torch.equal(got, want), f"{n} gave {got}")
    checks.check(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size, size], "after")


@MORE_THAN_ONE
def test_a_request_waits_for_the_others_while_they_run_other_calls(checks):
    """Rank 0 submits 'late' first; the others submit it only after a blocking allreduce
    and a barrier, which run meanwhile on every rank. Until then rank 0's handle is not
    done (poll() False); then it completes."""
    x = make(rank, (5,), torch.float64, 30)
    if rank == 0:
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="late")
        checks.check(not hvd.poll(handle), "poll() True before the others submitted 'late'")
    first = hvd.allreduce(x, op=hvd.Max, name="first")
    hvd.barrier()
    if rank:
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="late")
    xs = everyone((5,), torch.float64, 30)
    checks.check(torch.equal(first, xs.max(0).values), "the allreduce run in between")
    checks.check(torch.equal(hvd.synchronize(handle), xs.sum(0)), "'late'")


@MORE_THAN_ONE
def test_an_asynchronous_call_does_not_wait_for_the_others(checks):
    """Rank 0 submits 'early' and then meets the others in an MPI barrier of its own; they
    submit 'early' only after that barrier. An asynchronous call does not wait for the
    other ranks (as Horovod's, whose background thread negotiates): where it waited for
    them to reach a round, rank 0 stayed in it while they waited in the barrier."""
    x = make(rank, (4,), torch.float64, 35)
    if rank == 0:
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="early")
    WORLD.Barrier()
    if rank == 0:
        got = hvd.synchronize(handle)
    else:
        got = hvd.allreduce(x, op=hvd.Sum, name="early")
    checks.check(torch.equal(got, everyone((4,), torch.float64, 35).sum(0)), "'early'")


@pytest.mark.mpi(ranks=(3, 4))
def test_asynchronous_calls_on_two_sets_in_opposite_orders(checks, dynamic_sets):
    """Ranks 0 and 1 submit on the global set and on the set of both in opposite orders,
    asynchronously, then rank 1 meets rank 0 in an MPI barrier on the pair's communicator
    while the others make a blocking call: the rounds that do not wait are finished in
    the same order of sets on every rank, so none waits in one set for a rank in the
    other."""
    pair = hvd.add_process_set([0, 1])
    x = make(rank, (2,), torch.float64, 36)
    if rank < 2:
        calls = {"g": lambda: hvd.allreduce_async(x, op=hvd.Sum, name="g"),
                 "p": lambda: hvd.allreduce_async(x, op=hvd.Max, name="p", process_set=pair)}
        got = {name: calls[name]() for name in ("gp" if rank == 0 else "pg")}
        pair.comm.Barrier()
        got = {name: hvd.synchronize(h) for name, h in sorted(got.items())}
        xs = everyone((2,), torch.float64, 36)
        checks.check(torch.equal(got["p"], xs[:2].max(0).values), f"'p' {got['p']}")
    else:
        got = {"g": hvd.allreduce(x, op=hvd.Sum, name="g")}
        xs = everyone((2,), torch.float64, 36)
    checks.check(torch.equal(got["g"], xs.sum(0)), f"'g' {got['g']}")
    hvd.remove_process_set(pair)


def test_a_name_is_free_again_once_poll_saw_it_complete(checks):
    """As in Horovod: an operation that poll() saw complete no longer holds its name, even
    before synchronize()."""
    x = make(rank, (3,), torch.float64, 37)
    first = hvd.allreduce_async(x, op=hvd.Sum, name="again")
    while not hvd.poll(first):
        pass
    second = hvd.allreduce_async(x * 2, op=hvd.Sum, name="again")
    xs = everyone((3,), torch.float64, 37).sum(0)
    checks.check(torch.equal(hvd.synchronize(first), xs), "the first 'again'")
    checks.check(torch.equal(hvd.synchronize(second), xs * 2), "the second 'again'")


@MORE_THAN_ONE
def test_poll_alone_makes_progress(checks):
    """Rank 0 submits 'a' and then only polls it; the others submit 'z' first, then 'a'.
    Rank 0's polls make the rounds that run 'a' (no other call of rank 0 is needed), and
    poll() was False at first: 'a' waited for the others."""
    x = make(rank, (3,), torch.float64, 40)
    if rank == 0:
        handles = {"a": hvd.allreduce_async(x, op=hvd.Sum, name="a")}
        polls = 0
        while not hvd.poll(handles["a"]):
            polls += 1
        checks.check(polls > 0, "poll() was True at once")
        handles["z"] = hvd.allreduce_async(x, op=hvd.Max, name="z")
    else:
        handles = {"z": hvd.allreduce_async(x, op=hvd.Max, name="z"),
                   "a": hvd.allreduce_async(x, op=hvd.Sum, name="a")}
    xs = everyone((3,), torch.float64, 40)
    checks.check(torch.equal(hvd.synchronize(handles["a"]), xs.sum(0)), "'a'")
    checks.check(torch.equal(hvd.synchronize(handles["z"]), xs.max(0).values), "'z'")


@MORE_THAN_ONE
def test_the_compiled_and_the_general_path_meet(checks):
    """Rank 0's allreduce takes the layer's general path (its tensor requires grad), the
    others' the compiled one; the factors are given as ints: the same call on every rank,
    run alike, and rank 0's gradient flows."""
    x = make(rank, (3,), torch.float64, 50).requires_grad_(rank == 0)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=1, postscale_factor=1)
    checks.check(torch.equal(out.detach(), everyone((3,), torch.float64, 50).sum(0)), "sum")
    if rank == 0:
        out.sum().backward()
        checks.check(x.grad is not None, "no gradient on rank 0")
    else:
        hvd.allreduce(torch.ones(3, dtype=torch.float64), op=hvd.Sum)  # rank 0's backward


@MORE_THAN_ONE
def test_shutdown_drops_the_errors_of_handles_never_synchronized(checks, dynamic_sets):
    """An asynchronous allreduce whose ranks differ (a mismatch kept for its synchronize())
    is never synchronized: hvd.shutdown() completes without raising it, on every rank."""
    hvd.allreduce_async(torch.ones(1 + rank), name="never synchronized")
    checks.run("shutdown", hvd.shutdown)
    hvd.init(process_sets="dynamic")


@MORE_THAN_ONE
def test_a_duplicate_name_is_refused_on_its_rank_only(checks):
    """A second request of a name in flight raises ValueError at once on the rank that
    submits it (as Horovod's test_horovod_allreduce_duplicate_name_error has it); the
    other ranks are not told, and the first request completes."""
    x = torch.ones(3)
    duplicate = lambda: hvd.allgather_async(x, name="twice")  # noqa: E731
    if rank == 0:
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="twice")
        checks.expect(ValueError, ["'twice'", "in flight"], duplicate)
        # refused arguments too: still this rank's own mistake, the first request goes on
        checks.expect(ValueError, ["'twice'", "in flight"],
                      lambda: hvd.allreduce_async(x, op=17, name="twice"))
    hvd.barrier()
    if rank:
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="twice")
        checks.expect(ValueError, ["'twice'", "in flight"], duplicate)
    hvd.barrier()
    checks.check(hvd.synchronize(handle).tolist() == [size] * 3, "the first 'twice'")


@MORE_THAN_ONE
def test_unnamed_calls_match_again_after_every_rank_waited_in_vain(checks):
    """Rank 0 leaves a loop of unnamed allreduces one call early (as a rank whose test
    failed leaves its loop) and calls allgather; the others wait in their last allreduce.
    Every rank raises HorovodMismatch naming what each waits for, none hangs, and the next
    unnamed allreduce and allgather match on every rank (their numbering set alike)."""
    x = torch.ones(2)

    def loop():
        for _ in range(2 if rank == 0 else 3):
            hvd.allreduce(x, op=hvd.Sum)
        hvd.allgather(x)

    checks.expect_everywhere(loop, ["waits for", "'allreduce.noname.", "'allgather.noname."])
    checks.check(hvd.allreduce(x, op=hvd.Sum).tolist() == [size] * 2, "unnamed allreduce after")
    checks.check(hvd.allgather(x).tolist() == [1.0] * (2 * size), "unnamed allgather after")


@pytest.mark.mpi(ranks=(3, 4))
def test_unnamed_calls_are_numbered_per_process_set(checks, dynamic_sets):
    """The even ranks make two unnamed allreduces on their set, the odd ranks one on
    theirs: an unnamed allreduce on the global set then matches on every rank (each set
    numbers its own unnamed calls)."""
    evens = hvd.add_process_set(list(range(0, size, 2)))
    odds = hvd.add_process_set(list(range(1, size, 2)))
    mine = evens if rank % 2 == 0 else odds
    for _ in range(2 if mine is evens else 1):
        hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine)
    checks.check(hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [size], "global after")
    hvd.remove_process_set(evens)
    hvd.remove_process_set(odds)


@MORE_THAN_ONE
def test_a_name_refused_earlier_is_refused_at_once_later(checks):
    """While rank 0 waits in 'w', the others refuse their 'x'; rank 0's later 'x' raises
    HorovodMismatch at once, without an exchange the others would wait in, and the next
    calls match."""
    x = torch.ones(2)
    if rank == 0:
        got = hvd.allreduce(x, op=hvd.Sum, name="w")
        checks.expect(hvd.HorovodMismatch, ["refused", "'x'"],
                      lambda: hvd.allreduce(x, op=hvd.Sum, name="x"))
    else:
        checks.expect(ValueError, ["op 17"], lambda: hvd.allreduce(x, op=17, name="x"))
        got = hvd.allreduce(x, op=hvd.Sum, name="w")
    checks.check(got.tolist() == [size] * 2, "'w'")
    checks.check(hvd.allreduce(x, op=hvd.Sum, name="y").tolist() == [size] * 2, "'y' after")


@MORE_THAN_ONE
def test_join_lets_the_ranks_own_requests_run_with_its_data(checks, dynamic_sets):
    """Rank 0 submits 'a' and joins before the others have submitted it; they submit 'b'
    first, then 'a'. 'a' runs with rank 0's data (join() first waits for the rank's own
    requests), 'b' with zeros from rank 0, which has joined by then."""
    x = make(rank, (4,), torch.float64, 60)
    xs = everyone((4,), torch.float64, 60)
    if rank == 0:
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="a")
        hvd.join()
        checks.check(torch.equal(hvd.synchronize(handle), xs.sum(0)), "'a' on rank 0")
    else:
        b = hvd.allreduce_async(x * 2, op=hvd.Sum, name="b")
        a = hvd.allreduce_async(x, op=hvd.Sum, name="a")
        checks.check(torch.equal(hvd.synchronize(a), xs.sum(0)), "'a'")
        checks.check(torch.equal(hvd.synchronize(b), xs[1:].sum(0) * 2), "'b'")
        hvd.join()


@pytest.mark.mpi(ranks=(3, 4))
def test_shutdown_with_a_request_pending_on_another_set(checks, dynamic_sets):
    """Rank 0 has a request on the set of ranks 0 and 1 that rank 1 never submits (it
    refused its own call there): shutdown() leaves the global set first on every rank, so
    rank 0's wait on the other set learns that rank 1 shut down, instead of waiting on it
    while rank 1 waits on the global set."""
    pair = hvd.add_process_set([0, 1])
    if rank == 0:
        hvd.allreduce_async(torch.ones(1), name="never", process_set=pair)
    elif rank == 1:
        checks.expect(ValueError, ["op 17"], lambda: hvd.allreduce_async(
            torch.ones(1), name="bad", op=17, process_set=pair))
    checks.run("shutdown", hvd.shutdown)
    hvd.init(process_sets="dynamic")


@MORE_THAN_ONE
def test_a_refusal_fails_another_ranks_pending_request(checks):
    """Rank 0 submits 'r' and waits; the others refuse their 'r' (an op that is none):
    they raise ValueError, rank 0's synchronize() HorovodMismatch naming them, and its
    handle is gone."""
    if rank == 0:
        handle = hvd.allreduce_async(torch.ones(2), name="r")
        checks.expect(hvd.HorovodMismatch, ["rank 1", "refused", "'r'"],
                      lambda: hvd.synchronize(handle))
        checks.expect(ValueError, ["not pending"], lambda: hvd.poll(handle))
    else:
        checks.expect(ValueError, ["op 17"], lambda: hvd.allreduce_async(torch.ones(2),
                                                                          name="r", op=17))
    checks.check(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size, size], "after")


# --- process sets, join, timeline (dynamic process sets) -----------------------------------
@MORE_THAN_ONE
def test_process_sets(checks, dynamic_sets):
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    x = torch.tensor([float(rank)])
    got = hvd.allreduce(x, op=hvd.Sum, process_set=mine)
    checks.check(got.item() == sum(r for r in mine.ranks), f"process set allreduce {got}")
    checks.check(mine.included() and mine.rank() == mine.ranks.index(rank) and
                 mine.size() == len(mine.ranks), "process set queries")
    root = mine.ranks[-1]
    checks.check(hvd.broadcast(x, root, process_set=mine).item() == root,
                 "process set broadcast")
    checks.check(hvd.allgather(x, process_set=mine).tolist() == [float(r) for r in mine.ranks],
                 "process set allgather")
    other = odds if mine is evens else evens
    checks.expect(ValueError, ["not in", "process set"],
                  lambda: hvd.allreduce(x, process_set=other))
    checks.expect(ValueError, ["root_rank", "not in the process set"],
                  lambda: hvd.broadcast(x, other.ranks[0], process_set=mine))
    hvd.barrier(process_set=mine)
    checks.expect(ValueError, ["exists already"], lambda: hvd.add_process_set(list(range(size))))
    checks.check(hvd.remove_process_set(evens) and evens.process_set_id is None, "remove evens")
    hvd.remove_process_set(odds)
    checks.expect(ValueError, ["global process set"],
                  lambda: hvd.remove_process_set(hvd.global_process_set))


def test_join(checks, dynamic_sets):
    """The last rank runs out of data first; the others go on reducing; as in Horovod, what
    a joined rank cannot take part in (allgather, broadcast, alltoall, reducescatter)
    raises HorovodInternalError on the active ranks while the joined rank waits on."""
    steps = 3
    if rank == size - 1:
        last = hvd.join()
    else:
        for step in range(steps):
            got = hvd.allreduce(torch.tensor([1.0, float(rank)]), op=hvd.Sum, name=f"j{step}")
            checks.check(got.tolist() == [size - 1, sum(range(size - 1))],
                         f"joined allreduce {got}")
            # Average: the joined rank adds zeros; the sum is divided by the set's size
            got = hvd.allreduce(torch.tensor([1.0, float(rank)], dtype=torch.float64),
                                name=f"a{step}")
            checks.check(torch.allclose(got, torch.tensor([size - 1, sum(range(size - 1))],
                                                          dtype=torch.float64) / size),
                         f"joined average {got}")
            for what, call in [
                    ("allgather", lambda s=step: hvd.allgather(torch.tensor([rank]),
                                                               name=f"g{s}")),
                    ("broadcast", lambda s=step: hvd.broadcast(torch.ones(2), 0, name=f"b{s}")),
                    ("alltoall", lambda: hvd.alltoall(torch.ones(size))),
                    ("reducescatter", lambda: hvd.reducescatter(torch.ones(size)))]:
                checks.expect(hvd.HorovodInternalError, ["have joined", what], call)
        hvd.barrier()
        last = hvd.join()
    lasts = WORLD.allgather(last)  # one of the ranks that joined after the last one
    checks.check(len(set(lasts)) == 1 and (size == 1 or last != size - 1),
                 f"join returned {lasts}")
    # unnamed calls made while a rank had joined leave every rank's numbering alike
    if rank < size - 1:
        hvd.allreduce(torch.ones(1))
    hvd.join()
    checks.check(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size, size],
                 "unnamed allreduce after join")


@MORE_THAN_ONE
@pytest.mark.parametrize("call", ["allgather", "broadcast-own-root"])
def test_each_rank_joins_first_while_the_others_gather(checks, dynamic_sets, call):
    """Horovod's join tests: each rank in turn joins first while the others' allgather (or
    broadcast, each naming itself the root: calls that differ too) raises on them, the
    joined rank waiting on; then they join too, and join() returns the same rank
    everywhere, never the first to join."""
    refused = {
        "allgather": lambda: hvd.allgather(torch.ones(3, 2)),
        "broadcast-own-root": lambda: hvd.broadcast(torch.ones(2), rank, name="own root")}[call]
    for first in range(size):
        if rank == first:
            last = hvd.join()
        else:
            checks.expect(RuntimeError, [], refused)
            last = hvd.join()
        checks.check(last != first, f"join returned the first rank to join, {first}")
        everyone = hvd.allgather_object(last)
        checks.check(everyone == [last] * size, f"join returned {everyone}")


@MORE_THAN_ONE
def test_unnamed_grouped_calls_refused_while_joined_keep_numbering_alike(checks, dynamic_sets):
    """Unnamed grouped calls the active ranks make (refused) while a rank has joined leave
    every rank's numbering alike: the same unnamed call works everywhere after."""
    if rank == 0:
        hvd.join()
    else:
        checks.expect(RuntimeError, ["have joined"],
                      lambda: hvd.grouped_allgather([torch.ones(2), torch.ones(1)]))
        hvd.join()
    got = hvd.grouped_allgather([torch.ones(2), torch.ones(1)])
    checks.check([g.tolist() for g in got] == [[1.0] * 2 * size, [1.0] * size],
                 f"grouped allgather after join: {got}")


def test_grouped_async_refused_part_way_leaves_nothing_in_flight(checks):
    """A grouped call whose second tensor is refused finishes the first before raising:
    the same name can be used again at once."""
    bad = [torch.ones(2), torch.tensor(1.0)]  # a 0-d tensor cannot be gathered
    checks.expect(ValueError, ["at least one dimension"],
                  lambda: hvd.grouped_allgather_async(bad, name="part way"))
    got = hvd.synchronize(hvd.grouped_allgather_async([torch.ones(2)], name="part way"))
    checks.check(got[0].tolist() == [1.0] * 2 * size, f"grouped allgather again: {got}")


def test_join_optimizer(checks, dynamic_sets):
    """The last rank trains one step and joins; the others train two, the joined rank's
    share of the second step's average being zero."""
    torch.manual_seed(5)
    model = torch.nn.Linear(3, 2, dtype=torch.float64)
    reference = torch.nn.Linear(3, 2, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    data = [make(r, (4, 3), torch.float64, 70) for r in range(size)]
    mine = 1 if rank == size - 1 and size > 1 else 2
    for step in range(2):
        active = [r for r in range(size) if step < (1 if r == size - 1 and size > 1 else 2)]
        grads = []
        for r in active:  # the reference: each rank's gradient, averaged over all ranks
            reference.zero_grad()
            reference(data[r] * (step + 1)).pow(2).sum().backward()
            grads.append([q.grad.clone() for q in reference.parameters()])
        with torch.no_grad():
            for i, q in enumerate(reference.parameters()):
                q -= 0.1 * sum(g[i] for g in grads) / size
        if step < mine:
            opt.zero_grad()
            model(data[rank] * (step + 1)).pow(2).sum().backward()
            opt.step()
            checks.check(all(torch.allclose(a, b) for a, b in
                             zip(model.parameters(), reference.parameters(), strict=True)),
                         f"DistributedOptimizer step {step} with a joined rank")
    last = hvd.join()
    lasts = WORLD.allgather(last)
    checks.check(len(set(lasts)) == 1 and (size == 1 or last != size - 1),
                 f"join after training returned {lasts} (rank {size - 1} joined first)")
    # then every rank trains on, from the same parameters (the joined rank took no step
    # meanwhile): each optimizer's choice of schedule ("auto" counts steps, and the ranks
    # ran different numbers) starts again alike on every rank
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(3):
        opt.zero_grad()
        model(data[rank] * (step + 3)).pow(2).sum().backward()
        opt.step()
    mine = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    checks.check(all(torch.equal(mine, theirs) for theirs in WORLD.allgather(mine)),
                 "the ranks' parameters after training on past join()")


@MORE_THAN_ONE
def test_join_returns_the_rank_that_joined_last(checks, dynamic_sets):
    """Rank 0 joins half a second after the others: join() returns 0 on every rank."""
    if rank == 0:
        time.sleep(0.5)
    lasts = WORLD.allgather(hvd.join())
    checks.check(lasts == [0] * size, f"join() returned {lasts}")


@MORE_THAN_ONE
def test_a_failed_step_leaves_the_optimizer_usable(checks, dynamic_sets):
    """A step whose reduction raised (op=hvd.Max while the last rank has joined): the
    optimizer's next step runs, with every rank's gradient."""
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   op=hvd.Max)

    def step(k: float) -> None:
        opt.zero_grad()
        (w * k).sum().backward()
        opt.step()

    if rank == size - 1:
        hvd.join()
    else:
        checks.expect(hvd.HorovodInternalError, ["joined"], lambda: step(1.0))
        hvd.join()
    step(float(rank + 1))
    checks.check(w.tolist() == [-float(size)] * 3, f"the step after a failed one: {w.tolist()}")


@pytest.mark.mpi(ranks=(3, 4))
def test_a_rank_in_a_collective_on_a_set_learns_that_the_others_shut_down(checks,
                                                                           dynamic_sets):
    """Rank 1 is in an allreduce on the set of ranks 0 and 1 while the others shut down:
    shutdown() tells every set at once, so rank 1 raises instead of waiting for rank 0,
    which would otherwise wait for it on the global set."""
    pair = hvd.add_process_set([0, 1])
    if rank == 1:
        checks.expect(hvd.HorovodInternalError, ["rank 0", "shut down"],
                      lambda: hvd.allreduce(torch.ones(2), name="x", process_set=pair))
    checks.run("shutdown", hvd.shutdown)
    hvd.init(process_sets="dynamic")


def test_timeline(checks, dynamic_sets, shared_tmp_path):
    path = shared_tmp_path / "hvd_timeline.json"
    hvd.start_timeline(str(path))  # one file, written by rank 0 alone
    hvd.allreduce(torch.ones(3), name="traced")
    hvd.synchronize(hvd.allgather_async(torch.ones(2), name="gathered"))
    hvd.stop_timeline()
    hvd.barrier()
    if rank != 0:
        return
    with open(path) as fh:
        events = json.load(fh)
    names = {(e["name"], e["tid"]) for e in events}
    checks.check({("NEGOTIATE_ALLREDUCE", "traced"), ("ALLREDUCE", "traced"),
                  ("ALLGATHER", "gathered")} <= names, f"timeline events {names}")
    checks.check(all(e["ph"] == "X" and e["dur"] >= 0 for e in events), "timeline event form")


# --- errors --------------------------------------------------------------------------------
# Collectives that differ between the ranks: (the call, words of the error, the error the
# ranks that made the mistake raise instead of CollectiveMismatch). Rank 0 differs.
_x = torch.ones(4)
MISMATCHES = {
    "shape": (lambda: hvd.allreduce(torch.ones((4,) if rank else (5,))), ["shape", "rank 0"],
              None),
    "dtype": (lambda: hvd.allreduce(_x.to(torch.float64 if rank else torch.float32)),
              ["dtype"], None),
    "op": (lambda: hvd.allreduce(_x, op=hvd.Sum if rank else hvd.Max), ["op"], None),
    "root": (lambda: hvd.broadcast(_x, rank % 2), ["root rank"], None),
    "name": (lambda: hvd.allreduce(_x, name=f"n{rank % 2}"), ["name"], None),
    "trailing_shape": (lambda: hvd.allgather(torch.ones(2, 1 + (rank == 0))),
                       ["trailing shape"], None),
    "contiguous": (lambda: hvd.allreduce(torch.ones(4, 4).t() if rank == 0 else
                                         torch.ones(4, 4)), ["rank 0", "contiguous"],
                   ValueError),
    # rank 0's unnamed-allgather numbering stays one behind the others' until hvd.init()
    "call": (lambda: hvd.allgather(_x) if rank else hvd.barrier(), ["call"], None),
    "refused_tensor": (lambda: hvd.allgather(_x if rank else None), ["rank 0", "refused"],
                       TypeError),
    "refused_op": (lambda: hvd.allreduce(_x, op=hvd.Sum if rank else 17),
                   ["rank 0", "refused"], ValueError),
}


@MORE_THAN_ONE
@pytest.mark.parametrize("mistake", MISMATCHES)
def test_mismatch(checks, dynamic_sets, mistake):
    """Every rank raises, none waits; after the error the collectives still work."""
    fn, words, own_error = MISMATCHES[mistake]
    checks.expect_everywhere(fn, words, own_error=own_error)
    checks.check(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size, size],
                 "after errors")


@MORE_THAN_ONE
def test_process_set_change_meets_a_collective_as_a_mismatch(checks, dynamic_sets):
    """A rank still in a collective while the others add or remove a process set: every
    rank raises HorovodMismatch (where the two met in MPI, the job hung), and the set is
    neither made nor removed half-way."""
    x = torch.ones(size * 2)
    checks.expect_everywhere(lambda: hvd.reducescatter(x, name="rs") if rank == 0 else
                             hvd.add_process_set([1]), ["call", "hvd.add_process_set"])
    ps = hvd.add_process_set([1])
    checks.expect_everywhere(lambda: hvd.allreduce(x, name="ar") if rank == 0 else
                             hvd.remove_process_set(ps), ["call", "hvd.remove_process_set"])
    checks.check(hvd.remove_process_set(ps), "the set is still there to remove")
    checks.check(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size, size],
                 "after errors")


@MORE_THAN_ONE
def test_a_rank_that_shuts_down_is_learned_by_the_others(checks, dynamic_sets):
    """Rank 0 shuts down while the others submit an allreduce and then an allgather: they
    raise HorovodInternalError naming rank 0, the second at once; then all start again."""
    if rank == 0:
        hvd.shutdown()
    else:
        for call in (lambda: hvd.allreduce(torch.ones(2), name="late"),
                     lambda: hvd.allgather(torch.ones(1), name="later")):
            checks.expect(hvd.HorovodInternalError, ["rank 0", "shut down"], call)
        hvd.shutdown()
    hvd.init(process_sets="dynamic")
    checks.check(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size, size],
                 "after init")


@MORE_THAN_ONE
def test_unnamed_calls_numbered_afresh_after_init(checks):
    """A mismatch that left the ranks' unnamed-call numbers apart (rank 0 called barrier,
    the others an unnamed allgather) does not outlive hvd.shutdown() and hvd.init()."""
    checks.expect_everywhere(MISMATCHES["call"][0], ["call"])
    hvd.shutdown()
    hvd.init()
    try:
        got = hvd.allgather(torch.ones(1)).tolist()
    except Exception as exc:  # noqa: BLE001
        got = repr(exc)
    checks.check(got == [1.0] * size, f"unnamed allgather after init: {got}")


def test_refused_arguments(checks, dynamic_sets):
    x = torch.ones(4)
    checks.expect(ValueError, ["Adasum", "hvd.Average"], lambda: hvd.allreduce(x, op=hvd.Adasum),
                  x)
    checks.expect(ValueError, ["bool"], lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool),
                                                              op=hvd.Sum))
    if size > 1:
        checks.expect(ValueError, ["splits"], lambda: hvd.alltoall(torch.ones(size * 2 + 1)))
        checks.expect(ValueError, ["splits"],
                      lambda: hvd.alltoall(torch.ones(3), splits=[3] * size))
    # splits valid in value but not int32, as Horovod refuses them: a ValueError everywhere
    checks.expect(ValueError, ["splits", "torch.int32"], lambda: hvd.alltoall(
        torch.ones(size), splits=torch.ones(size, dtype=torch.float32)))
    # Adasum in a reduce-scatter: Horovod raises a RuntimeError; it is also a ValueError
    checks.expect(RuntimeError, ["Adasum"], lambda: hvd.reducescatter(torch.ones(size * 2),
                                                                     op=hvd.Adasum))
    checks.expect(ValueError, ["Adasum"], lambda: hvd.reducescatter(torch.ones(size * 2),
                                                                   op=hvd.Adasum))
    checks.expect(ValueError, ["both"], lambda: hvd.allreduce(x, average=True, op=hvd.Sum))
    h = hvd.allreduce_async(x, name="dup")
    checks.expect(ValueError, ["dup", "in flight"], lambda: hvd.allreduce_async(x, name="dup"))
    hvd.synchronize(h)
    checks.expect(ValueError, ["not pending"], lambda: hvd.synchronize(h))
    # after errors the collectives still work
    checks.check(hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size, size],
                 "after errors")


def test_restart(checks, dynamic_sets):
    """shutdown(), then init() with a static process set: dynamic sets are refused."""
    hvd.shutdown()
    checks.check(not hvd.is_initialized(), "shutdown")
    checks.expect(ValueError, ["hvd.init()"], lambda: hvd.rank())
    first = hvd.ProcessSet([0])
    hvd.init(process_sets=[first] if size > 1 else None)
    if size > 1:
        checks.check(first.process_set_id is not None and first.ranks == [0],
                     f"static set {first}")
        if rank == 0:
            checks.check(hvd.allreduce(torch.ones(1), process_set=first).item() == 1.0,
                         "static set")
    checks.expect(ValueError, ["dynamic"], lambda: hvd.add_process_set([0]))
