"""Debug mode (FASTREDUCE_DEBUG=1): calls that differ between the ranks of a communicator
raise the same CollectiveMismatch on every rank, naming what differs, in the core, the
layers and the torch backend; matching calls are unaffected. Ranks that call all-reduces
on two communicators in different orders (a deadlock in MPI) all raise the same
CollectiveMismatch within seconds instead of waiting forever."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

import fastreduce
from fastreduce import CollectiveMismatch

pytestmark = pytest.mark.timeout(100)  # a hang shows where, long before the job's guard

# The cases of the old debug_mode worker (different counts, dtypes, ops, a skipped call,
# blocking against non-blocking, in the core, the layers and the torch backend), and
# those of the old debug_order worker (different orders on two communicators).
mismatch_case = pytest.mark.mpi(ranks=(1, 2, 4))
order_case = pytest.mark.mpi(ranks=(2, 3, 4))


@pytest.fixture(scope="module", autouse=True)
def debug_mode():
    """Debug mode on for this module's cases (as FASTREDUCE_DEBUG=1 puts it on at import),
    then back to the environment's setting."""
    assert not fastreduce.checks.debug(), "the session must not run in debug mode"
    fastreduce.set_debug(True)
    yield
    fastreduce.set_debug(None)


@pytest.fixture
def debug_checks(checks):
    """`checks`, after checking that debug mode is on."""
    checks.check(fastreduce.checks.debug(), "debug mode is not on")
    return checks


def expect_everywhere(checks, fn, words):
    """Every rank raises CollectiveMismatch with `words`, the same message everywhere."""
    checks.expect_everywhere(fn, words, same_message=True)


def needs_two_ranks(comm):
    if comm.size == 1:
        pytest.skip("a mismatch needs two ranks")


# -- calls that differ between ranks ----------------------------------------------------

@mismatch_case
@pytest.mark.across_nodes
def test_setup_refused_everywhere(debug_checks, comm):
    """Every rank refusing a set-up call alike (the same bytes exchanged): each raises its
    own error, as outside debug mode, and nothing is made."""
    p = comm.size
    debug_checks.expect(ValueError, ["repeat a rank"],
                        lambda: fastreduce.Partition().create_partition_inclusive([0, 0]))
    debug_checks.expect(ValueError, ["not in this partition"],
                        lambda: fastreduce.Partition().create_partition_inclusive([p]))


@mismatch_case
@pytest.mark.across_nodes
@pytest.mark.parametrize("form", ["allreduce_", "iallreduce", "coalesced"])
def test_matching_calls_work(form, debug_checks, comm):
    """Calls that match on every rank give the usual results in debug mode."""
    p, rank = comm.size, comm.rank
    if form == "allreduce_":
        x = torch.full((5,), float(rank))
        fastreduce.allreduce_(x)
        debug_checks.check(torch.equal(x, torch.full((5,), float(sum(range(p))))),
                           "allreduce_ in debug mode")
    elif form == "iallreduce":
        y = fastreduce.iallreduce(np.arange(4.0) * rank).wait()
        debug_checks.check(np.array_equal(y, np.arange(4.0) * sum(range(p))),
                           "iallreduce in debug mode")
    else:
        ts = [torch.ones(3), torch.ones(2, dtype=torch.int32)]
        fastreduce.allreduce_coalesced_(ts)
        debug_checks.check(all(int(t[0]) == p for t in ts), "coalesced in debug mode")


def _count(p, rank):
    n = 4 if rank != p - 1 else 5  # the last rank passes one element more
    return (lambda: fastreduce.allreduce_(torch.zeros(n)),
            ["count", f"rank {p - 1} passed 5", "allreduce_"])


def _dtype(p, rank):
    dtype = torch.float64 if rank == 0 else torch.float32
    return (lambda: fastreduce.allreduce(torch.zeros(3, dtype=dtype)),
            ["dtype", "float64", "float32"])


def _op(p, rank):
    op = "max" if rank == 1 else "sum"
    return (lambda: fastreduce.allreduce_(torch.zeros(3), op), ["op", "'max'", "rank 1"])


def _skipped_call(p, rank):
    # a rank that skipped a call: its next call pairs with the one it skipped
    n = 7 if rank == 0 else 2
    return (lambda: fastreduce.allreduce_(torch.zeros(n)), ["count", "rank 0 passed 7"])


@mismatch_case
@pytest.mark.across_nodes
@pytest.mark.parametrize("mismatch", [
    pytest.param(_count, id="count"),
    pytest.param(_dtype, id="dtype"),
    pytest.param(_op, id="op"),
    pytest.param(_skipped_call, id="skipped-call"),
])
def test_mismatch(mismatch, debug_checks, comm):
    """One argument differs between the ranks: CollectiveMismatch everywhere, naming it."""
    needs_two_ranks(comm)
    call, words = mismatch(comm.size, comm.rank)
    expect_everywhere(debug_checks, call, words)


@mismatch_case
@pytest.mark.across_nodes
def test_blocking_against_nonblocking(debug_checks, comm):
    """A blocking call on some ranks, a non-blocking one on others, on the same
    communicator: CollectiveMismatch everywhere; after it the communicator still works."""
    needs_two_ranks(comm)
    p, rank = comm.size, comm.rank
    dup = comm.Dup()

    def mixed():
        x = torch.zeros(3)
        if rank == 0:
            fastreduce.iallreduce_(x, comm=dup).wait()
        else:
            fastreduce.allreduce_(x, comm=dup)

    expect_everywhere(debug_checks, mixed, ["call", "iallreduce_", "allreduce_"])
    x = torch.ones(2)
    fastreduce.allreduce_(x, comm=dup)
    debug_checks.check(torch.equal(x, torch.full((2,), float(p))), "allreduce after mismatches")
    dup.Free()


@mismatch_case
@pytest.mark.across_nodes
def test_layer(debug_checks, comm):
    """A layer's forward and backward in debug mode; different counts in its forward."""
    from fastreduce.nn import AllSumReduce

    p, rank = comm.size, comm.rank
    P = fastreduce.Partition().create_cartesian_topology_partition([p])
    layer = AllSumReduce(P, axes_reduce=[0])
    x = torch.ones(3, requires_grad=True)
    layer(x).sum().backward()
    debug_checks.check(torch.equal(x.grad, torch.full((3,), float(p))),
                       "layer backward in debug mode")
    if p > 1:
        n = 3 if rank else 4
        expect_everywhere(debug_checks, lambda: layer(torch.ones(n)), ["count"])


@mismatch_case
@pytest.mark.across_nodes
def test_gradient_sync(debug_checks):
    """GradientSync's buckets in debug mode."""
    model = torch.nn.Linear(4, 2)
    sync = fastreduce.GradientSync(model)
    model(torch.ones(1, 4)).sum().backward()
    sync.wait()
    debug_checks.check(model.weight.grad is not None, "GradientSync in debug mode")


@mismatch_case
@pytest.mark.across_nodes
def test_torch_backend(debug_checks, comm):
    """The torch.distributed backend: a different root, shape, op, dtype, or all-to-all
    splits that do not pair up (what torch's DETAIL mode checks); the data stays as it
    was."""
    import torch.distributed as dist

    import fastreduce.distributed  # noqa: F401

    p, rank = comm.size, comm.rank
    dist.init_process_group("fastreduce")
    t = torch.ones(2)
    dist.broadcast(t, src=0)
    if p > 1:
        src = 0 if rank else 1
        expect_everywhere(debug_checks, lambda: dist.broadcast(torch.ones(2), src=src),
                          ["root"])
        n = 2 if rank else 3
        expect_everywhere(debug_checks,
                          lambda: dist.all_gather_into_tensor(torch.empty(p * n),
                                                              torch.ones(n)), ["shapes"])
        # the same number of elements in another shape: MPI would take it, torch does not
        shape = (2, 3) if rank else (3, 2)
        mine = torch.full(shape, float(rank + 1))
        expect_everywhere(debug_checks, lambda: dist.all_reduce(mine), ["shapes", "[2, 3]"])
        debug_checks.check(torch.equal(mine, torch.full(shape, float(rank + 1))),
                           f"all_reduce's tensor changed: {mine}")
        expect_everywhere(debug_checks, lambda: dist.broadcast(mine, src=0), ["shapes"])
        expect_everywhere(debug_checks, lambda: dist.reduce_scatter_tensor(
            torch.zeros(shape), torch.ones(p, *shape)), ["shapes"])
        op = dist.ReduceOp.SUM if rank else dist.ReduceOp.MAX
        kept = torch.full((3,), float(rank + 1))
        expect_everywhere(debug_checks, lambda: dist.reduce(kept, dst=0, op=op), ["op"])
        debug_checks.check(torch.equal(kept, torch.full((3,), float(rank + 1))),
                           f"reduce's tensor changed: {kept}")
        dtype = torch.float32 if rank else torch.int32
        expect_everywhere(debug_checks, lambda: dist.reduce_scatter_tensor(
            torch.zeros(2, dtype=dtype), torch.ones(2 * p, dtype=dtype)), ["dtype"])
        # rank 0 sends 2 rows to everyone; the others expect 1 row from rank 0
        send = [2] * p if rank == 0 else [1] * p
        recv = [1] * p if rank else [2] + [1] * (p - 1)
        expect_everywhere(debug_checks, lambda: dist.all_to_all_single(
            torch.zeros(sum(recv)), torch.ones(sum(send)), recv, send), ["do not pair up"])
    dist.destroy_process_group()


# -- collectives issued in different orders ---------------------------------------------

# How late a late rank is: past the report (0.5 s) and the grace a stable picture needs
# before it is called a deadlock (checks._GRACE, 1 s), so that a late rank wrongly taken
# for a deadlock would raise
LATE = 2.0


@pytest.fixture
def quick_reports():
    """Debug mode with waits reported after 0.5 s (not 10), restored afterwards."""
    before = fastreduce.checks._report_after
    fastreduce.set_debug(True, report_after=0.5)
    yield
    fastreduce.checks._report_after = before


@pytest.fixture
def first_and_second(comm, quick_reports):
    """Two communicators with the same members, told apart only by name."""
    first = fastreduce.Partition(comm.Dup())
    second = fastreduce.Partition(comm.Dup())
    first.comm.Set_name("first")
    second.comm.Set_name("second")
    return first, second


@order_case
def test_matching_orders_however_late(first_and_second, checks, comm):
    """Matching orders work, however late a rank is: the others report, then it arrives."""
    first, second = first_and_second
    x = torch.ones(4)
    if comm.rank == 0:
        time.sleep(LATE)
    fastreduce.allreduce_(x, comm=first.comm)
    fastreduce.allreduce_(x, comm=second.comm)
    checks.check(torch.equal(x, torch.full((4,), float(comm.size ** 2))),
                 f"matching order gave {x}")


@order_case
def test_chain_that_resolves(quick_reports, checks, comm):
    """A chain of waits that resolves: rank 0 waits on {0, 1}, rank 1 first on {1, 2},
    rank 2 is late."""
    rank = comm.rank
    if comm.size < 3:
        pytest.skip("the chain needs three ranks")
    pair = comm.Split(0 if rank < 2 else MPI.UNDEFINED)
    later = comm.Split(0 if rank in (1, 2) else MPI.UNDEFINED)
    y = torch.ones(2)
    if rank == 2:
        time.sleep(LATE)
    if rank in (1, 2):
        fastreduce.allreduce_(y, comm=later)
    if rank < 2:
        fastreduce.allreduce_(y, comm=pair)
    expected = {0: 3.0, 1: 3.0, 2: 2.0}.get(rank, 1.0)
    checks.check(torch.equal(y, torch.full((2,), expected)), f"the chain gave {y}")


@order_case
def test_different_orders_raise_everywhere(first_and_second, checks, comm):
    """All-reduces on two communicators in different orders (a deadlock) raise the same
    CollectiveMismatch on every rank within seconds; the program goes on on other
    communicators, where a late rank is not taken for a deadlock."""
    first, second = first_and_second
    p, rank = comm.size, comm.rank
    started = time.monotonic()
    order = [second, first] if rank == 0 else [first, second]
    try:
        for part in order:
            fastreduce.allreduce_(torch.ones(4), comm=part.comm)
    except CollectiveMismatch as exc:
        outcome = str(exc)
        if rank == 0:
            print(outcome, flush=True)
        for words in ("rank 0 waits in allreduce_", "'second'", "'first'",
                      "in the same order"):
            checks.check(words in outcome, f"the message lacks {words!r}: {outcome}")
    except Exception as exc:  # noqa: BLE001
        outcome = f"other: {exc!r}"
    else:
        outcome = "nothing raised"
    elapsed = time.monotonic() - started
    checks.check(elapsed < 20, f"the deadlock took {elapsed:.1f} s to be seen")
    outcomes = comm.allgather(outcome)
    checks.check(outcomes[0].startswith("fastreduce: collectives that can never complete"),
                 f"rank 0: {outcomes[0]}")
    checks.check(len(set(outcomes)) == 1, f"the ranks raised different things: {outcomes}")

    # a rank that raised is not taken for waiting
    third = comm.Dup()
    z = torch.ones(3)
    if rank == 0:
        time.sleep(LATE)  # the others report waiting; rank 0 must not look stuck in 'second'
    try:
        fastreduce.allreduce_(z, comm=third)
    except CollectiveMismatch as exc:
        checks.check(False, f"a late rank after a raised deadlock was taken for a deadlock: "
                            f"{exc}")
    checks.check(torch.equal(z, torch.full((3,), float(p))), f"after the deadlock: {z}")
    if rank == 0:
        print(f"different orders on two communicators: seen in {elapsed:.1f} s", flush=True)
