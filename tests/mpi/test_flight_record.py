"""While a timeout is set (by default: 600 s), the flight record holds every collective
fastreduce issued, in order, with its count, dtype and state: the core's forms, coalesced
calls, and the torch.distributed backend's collectives and point-to-point calls. The
timeout is set and cleared here with fastreduce.set_timeout, and restored after."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import fastreduce

pytestmark = [pytest.mark.mpi(ranks=(1, 3)), pytest.mark.across_nodes]


def test_on_by_default(checks):
    """Unless FASTREDUCE_TIMEOUT says otherwise, the watchdog bounds every wait by 600 s
    (torch.distributed's bound) and every call is recorded."""
    if fastreduce.settings.is_set("FASTREDUCE_TIMEOUT"):
        pytest.skip("FASTREDUCE_TIMEOUT is set in this job's environment")
    checks.check(fastreduce.watchdog.timeout() == 600.0,
                 f"the default timeout is {fastreduce.watchdog.timeout()}")
    before = fastreduce.flight_record()
    fastreduce.allreduce_(torch.ones(3))
    after = fastreduce.flight_record()
    checks.check(bool(after) and after[-1]["call"] == "allreduce_"
                 and after[-1]["state"] == "done" and after != before,
                 f"the call was not recorded: {after[-1:]}")


def test_nothing_recorded_without_a_timeout(checks):
    """With the timeout off (set_timeout(None), FASTREDUCE_TIMEOUT=0), calls are not
    recorded."""
    old = fastreduce.watchdog.timeout()
    fastreduce.set_timeout(None)
    try:
        before = fastreduce.flight_record()
        fastreduce.allreduce_(torch.ones(3))  # not recorded: no timeout
        checks.check(fastreduce.flight_record() == before, "calls recorded without a timeout")
    finally:
        fastreduce.set_timeout(old)


def test_record_in_order(checks, comm):
    """With a timeout set, the record holds the core's calls, coalesced calls and the
    backend's collectives and point-to-point calls, in order, done or started."""
    import torch.distributed as dist

    import fastreduce.distributed  # noqa: F401

    p, rank = comm.size, comm.rank
    earlier = {e["number"] for e in fastreduce.flight_record()}  # other cases' entries
    old = fastreduce.watchdog.timeout()
    fastreduce.set_timeout(600)
    try:
        fastreduce.allreduce_(torch.ones(3))
        fastreduce.allreduce(np.ones(5, dtype=np.int32), "max")
        request = fastreduce.iallreduce_(torch.ones(7, dtype=torch.float64))
        started = fastreduce.flight_record()[-1]
        request.wait()
        fastreduce.allreduce_coalesced_([torch.ones(2), torch.ones(4),
                                         torch.ones(1, dtype=torch.int64)])
        dist.init_process_group("fastreduce")
        dist.all_reduce(torch.ones(6))
        if p > 1:
            peer = (rank + 1) % p, (rank - 1) % p
            sent = dist.isend(torch.ones(8), dst=peer[0])
            dist.recv(torch.empty(8), src=peer[1])
            sent.wait()
        dist.destroy_process_group()
        record = [e for e in fastreduce.flight_record() if e["number"] not in earlier]
    finally:
        fastreduce.set_timeout(old)

    checks.check(started["call"] == "iallreduce_" and started["state"] == "started",
                 f"a request not yet waited for: {started}")
    expected = [("allreduce_", 3, "float32"), ("allreduce", 5, "int32"),
                ("iallreduce_", 7, "float64"), ("allreduce_coalesced_", 7, "int64+float32"),
                ("allreduce_", 6, "float32")]  # the backend's all_reduce is the core's
    if p > 1:
        expected += [(f"isend to {(rank + 1) % p}", 8, "float32"),
                     (f"irecv from {(rank - 1) % p}", 8, "float32")]  # the core's too
    got = [(e["call"], e["count"], e["dtype"]) for e in record]
    # the backend may add its own set-up collectives (barriers): the expected ones, in order
    pos = 0
    for e in got:
        if pos < len(expected) and e == expected[pos]:
            pos += 1
    checks.check(pos == len(expected), f"the record {got} lacks {expected[pos:]} (in this order)")
    checks.check(all(e["state"] == "done" for e in record),
                 f"states: {[e['state'] for e in record]}")
    numbers = [e["number"] for e in record]
    checks.check(numbers == sorted(numbers) and len(set(numbers)) == len(numbers),
                 f"numbers {numbers}")


def test_a_communicators_own_bound(checks, comm, monkeypatch):
    """A call waited for on a communicator with a bound of its own is stuck past that bound,
    also with the process's timeout off, and not on another communicator; the bound goes
    when removed (what a torch.distributed group's timeout does; the job's end itself is
    tests/launch/test_watchdog.py's). The bound is set in the compiled core's table only,
    and the watchdog's own view emptied meanwhile: it would end this job."""
    from fastreduce import watchdog
    from fastreduce.backend import collectives

    old = watchdog.timeout()
    bounded, other = comm.Dup(), comm.Dup()
    monkeypatch.setattr(watchdog, "_bounds", {})  # (the groups' bounds of earlier tests)
    fastreduce.set_timeout(None)  # with no bound it knows of, the watchdog stops looking
    collectives.set_flight_record(64, watchdog.recorded)
    key = collectives.set_comm_bound(bounded, 0.05)
    try:
        entries = [collectives.flight_begin("waited", c, 1, "float32") for c in (bounded, other)]
        for entry in entries:
            collectives.flight_waiting(entry)
        time.sleep(0.2)
        stuck = collectives.flight_stuck(0.0)
        checks.check(stuck == entries[0], f"stuck: {stuck}, expected #{entries[0]} "
                     f"(the bounded communicator's call), not #{entries[1]}")
        checks.check(collectives.flight_stuck(10.0) == entries[0], "the sooner bound wins")
        collectives.clear_comm_bound(key)
        checks.check(collectives.flight_stuck(0.0) is None, "a removed bound still counts")
        for entry in entries:
            collectives.flight_end(entry)
    finally:
        collectives.clear_comm_bound(key)
        fastreduce.set_timeout(old)
        bounded.Free()
        other.Free()


def test_a_bound_is_named_and_goes_with_its_communicator(checks, comm):
    """The watchdog names the bound a stuck call went past; an earlier setting's remover
    leaves a later one in place; once its communicator is freed the bound no longer
    counts, also for another object holding the same handle (as a new communicator that
    MPI gives the freed one's handle does)."""
    from fastreduce import watchdog
    from fastreduce.backend import collectives

    bounded = comm.Dup()
    alias = type(bounded).fromhandle(bounded.handle)  # the same handle, another object
    first = watchdog.bound_communicator(bounded, 500.0, "a test's bound")
    entry = collectives.flight_begin("waited", bounded, 1, "float32")
    try:
        checks.check(watchdog._bound_of(entry) == (500.0, "a test's bound"),
                     f"named bound {watchdog._bound_of(entry)}")
        watchdog.bound_communicator(bounded, 400.0, "a later bound")
        first()  # the earlier setting's remover: the later one stays
        checks.check(collectives.comm_bound_seconds(alias) == 400.0,
                     f"bound after an earlier remover: {collectives.comm_bound_seconds(alias)}")
    finally:
        collectives.flight_end(entry)
        bounded.Free()
    checks.check(collectives.comm_bound_seconds(alias) == 0.0,
                 f"a freed communicator's handle is still bounded "
                 f"({collectives.comm_bound_seconds(alias)} s)")
    watchdog.bound_communicator(alias, None)  # (its entries go; nothing counted them)
