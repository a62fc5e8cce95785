"""The progress engine (non-blocking staged GPU and large host requests), over the fake
CUDA runtime (tests/support/fakecuda).

  start       starting a request does not wait for the GPU: the producer's delayed write
              is still pending when iallreduce_ returns, and is what gets reduced
  buckets     consecutive buckets, each started as its kernel is queued: the host never
              waits for the GPU, and the first is reduced while the GPU computes the last
  in flight   many requests on several communicators, waited for in another order on
              every rank (and with test() and wait_all), all correct
  dropped     requests dropped without wait() still complete, buffers kept until then
  failures    a CUDA error on one rank, when the job starts, half-way through it, or while
              starting the request: that rank's wait() raises it, the others' wait() raise
              that it failed elsewhere (no rank hangs); the next requests work
  callbacks   Job.add_done_callback fires once, from the engine

Requests still pending at interpreter exit: tests/launch/test_engine_exit.py.
Every case is marked across_nodes: the pass on 3 nodes x 1 rank runs them again.
"""

from __future__ import annotations

import gc
import threading
import time

import fakecuda
import fakempi
import numpy as np
import pytest
from fakecuda import FakeCudaArray, Stream

import fastreduce
from fastreduce.backend import cudart as _cuda
from fastreduce.backend import engine as _engine

pytestmark = [pytest.mark.mpi(profile="fakecuda"), pytest.mark.across_nodes]


def values_of(n: int, r: int, dtype=np.float32, salt: int = 0) -> np.ndarray:
    return ((np.arange(n) * 7 + r * 3 + salt) % 5 + 1).astype(dtype)


def summed(n: int, ranks, dtype=np.float32, salt: int = 0) -> np.ndarray:
    return sum(values_of(n, r, dtype, salt).astype(np.float64) for r in ranks).astype(dtype)


@pytest.fixture(scope="module", autouse=True)
def not_cuda_aware():
    """The staged paths: the MPI is declared not CUDA-aware for the module; at its end the
    engine is idle and the fake device quiet."""
    fastreduce.set_cuda_aware(False)
    yield
    _engine.wait_idle()
    fakecuda.quiesce()
    fastreduce.set_cuda_aware(None)


@pytest.fixture(scope="module")
def comms(comm):
    """(communicators, the world ranks of each): the default one, a duplicate of the world,
    and (on 2 ranks or more) the halves by rank parity; the last two freed at the end."""
    made = [comm.Dup()]
    if comm.size > 1:
        made.append(comm.Split(comm.rank % 2, comm.rank))
    members = [list(range(comm.size)), list(range(comm.size))]
    if comm.size > 1:
        members.append([r for r in range(comm.size) if r % 2 == comm.rank % 2])
    yield [fastreduce.default_comm(), *made], members
    for c in made:
        c.Free()  # their engine duplicates are freed after their jobs
    _engine.wait_idle()


def test_the_engine_runs(checks):
    """The engine runs non-blocking calls here (the MPI gives MPI_THREAD_MULTIPLE)."""
    checks.check(_engine.state()[0], f"the engine runs here: {_engine.state()}")


@pytest.mark.parametrize("n", [1000, 600_000], ids=["whole", "pipelined"])
def test_start_does_not_wait_for_the_gpu(n, comm, checks):
    """The producer's delayed write is still pending when iallreduce_ returns, and is what
    gets reduced; without the engine's waits for the copies in, stale data."""
    rank, size = comm.rank, comm.size
    # (growing the pinned memory frees the old block, which waits for the whole device:
    # warm up first, as in a training loop's steady state)
    fastreduce.iallreduce_(FakeCudaArray.from_numpy(values_of(n, rank))).wait()
    gc.collect()  # (and free earlier arrays now: cudaFree waits for the whole device)
    stream = Stream()
    g = FakeCudaArray.from_numpy(np.zeros(n, np.float32), stream=stream)
    g.write(values_of(n, rank), delay_us=500_000)  # the producer's kernel, still running
    req = fastreduce.iallreduce_(g)
    checks.check(not stream.query(),
                 f"{n}: iallreduce_ waited on the host for the producer's stream")
    checks.check(req.wait() is g and np.array_equal(g.to_numpy(), summed(n, range(size))),
                 f"{n}: the delayed write is what got reduced")
    _cuda._set_skip_waits(True)  # without the engine's waits for the copies in: stale data
    try:
        g = FakeCudaArray.from_numpy(np.zeros(n, np.float32), stream=stream)
        g.write(values_of(n, rank), delay_us=300_000)
        result = fastreduce.iallreduce_(g).wait().to_numpy()
    finally:
        _cuda._set_skip_waits(False)
    if size > 1:
        checks.check(not np.array_equal(result, summed(n, range(size))),
                     f"{n}: the ordering check cannot fail")
    fakecuda.quiesce()


def test_buckets_overlap_the_gpus_compute(comm, checks):
    """Buckets of gradients as backward makes them on the GPU: each bucket's "kernel" (a
    delayed write on the compute stream) is queued, then its iallreduce_ started at once,
    as the bucket engine does. The host never waits for the GPU (the compute stream is
    still busy when every bucket has been started), and the first bucket is reduced
    (its MPI_Allreduce, from the fake MPI layer's log) while the GPU still computes the
    last one; each bucket's reduction starts after its kernel and its copy down end."""
    rank, size = comm.rank, comm.size
    buckets, delay_us = 3, 400_000
    sizes = [1000 * (k + 1) + 8 for k in range(buckets)]  # distinct: the logs name them
    fastreduce.iallreduce_(FakeCudaArray.from_numpy(values_of(sizes[0], rank))).wait()
    gc.collect()  # (warm: pinned memory and the engine's communicator made, frees done)
    stream = Stream()
    arrays = [FakeCudaArray.from_numpy(np.zeros(n, np.float32), stream=stream) for n in sizes]
    fakecuda.quiesce()
    fakecuda.log_copies(1000)
    fakempi.log_calls(1000)
    comm.Barrier()  # the ranks start together: the reductions wait for the slowest
    try:
        requests = []
        for k, (g, n) in enumerate(zip(arrays, sizes, strict=True)):
            g.write(values_of(n, rank, salt=k), delay_us=delay_us)
            requests.append(fastreduce.iallreduce_(g))
        checks.check(not stream.query(), "the host waited for the GPU while starting buckets")
        for k, (req, g, n) in enumerate(zip(requests, arrays, sizes, strict=True)):
            checks.check(req.wait() is g and np.array_equal(
                g.to_numpy(), summed(n, range(size), salt=k)), f"bucket {k}'s result")
        fakecuda.quiesce()
        copies, calls = fakecuda.copy_log(), fakempi.calls()
    finally:
        fakecuda.log_copies(0)
        fakempi.log_calls(0)

    def one(records, what, nbytes):
        found = [r for r in records if r["bytes"] == nbytes]
        checks.check(len(found) == 1, f"one {what} of {nbytes} bytes: {found}")
        return found[0] if found else {"start": 0, "end": 0}

    kernels = [one([c for c in copies if c["kind"] == "write"], "kernel", 4 * n) for n in sizes]
    downs = [one([c for c in copies if c["kind"] == "D2H"], "copy down", 4 * n) for n in sizes]
    reduced = [one(calls, "MPI_Allreduce", 4 * n) for n in sizes]
    for k in range(buckets):
        checks.check(kernels[k]["end"] <= downs[k]["start"] and downs[k]["end"] <= reduced[k][
            "start"], f"bucket {k}: kernel, copy down and reduction in that order")
    after = [(r["end"] - kernels[0]["end"]) / 1e6 for r in (reduced[0], kernels[-1])]
    checks.check(reduced[0]["end"] < kernels[-1]["end"],
                 f"bucket 0 was reduced while the GPU computed bucket {buckets - 1}: reduced "
                 f"{after[0]:.0f} ms after its kernel, the last kernel ended {after[1]:.0f} ms "
                 f"after it")


def test_many_requests_in_flight(comms, comm, checks):
    """24 requests on several communicators, waited for in another order on every rank
    (with test(), wait_all and wait), all correct."""
    comms, members = comms
    rank = comm.rank
    started = []
    for i in range(24):
        k = i % len(comms)
        n = (1000, 3000, 200_000)[i % 3]
        me = members[k].index(rank)
        g = FakeCudaArray.from_numpy(values_of(n, me, salt=i))
        started.append((fastreduce.iallreduce_(g, comm=comms[k]), g, n, k, i))
    order = list(range(len(started)))
    rng = np.random.default_rng(rank)
    rng.shuffle(order)  # every rank waits in its own order
    for j, index in enumerate(order):
        req, g, n, k, i = started[index]
        want = summed(n, range(len(members[k])), salt=i)
        if j % 3 == 0:
            while not req.test():
                pass
            got = g
        elif j % 3 == 1:
            got = fastreduce.wait_all([req])[0]
        else:
            got = req.wait()
        checks.check(got is g and np.array_equal(g.to_numpy(), want), f"request {i} on comm {k}")
        checks.check(req.done and req.wait() is g,
                     f"request {i}: done, and a second wait returns it")


def test_wait_all_out_of_place(comm, checks):
    """wait_all mixing host and GPU requests, out of place: x kept."""
    rank, size = comm.rank, comm.size
    g = FakeCudaArray.from_numpy(values_of(5000, rank))
    h = values_of(7, rank, np.float64)
    results = fastreduce.wait_all([fastreduce.iallreduce(g), fastreduce.iallreduce_(h),
                                   fastreduce.iallreduce(g, "max")])
    checks.check(np.array_equal(results[0].to_numpy(), summed(5000, range(size)))
                 and np.array_equal(results[1], summed(7, range(size), np.float64))
                 and np.array_equal(results[2].to_numpy(), values_of(5000, rank).copy() * 0
                                    + np.max([values_of(5000, r) for r in range(size)], axis=0))
                 and np.array_equal(g.to_numpy(), values_of(5000, rank)),
                 "wait_all, out of place")


def test_dropped_requests_deliver(comm, checks):
    """Requests dropped without wait() still complete, their buffers kept until then."""
    rank, size = comm.rank, comm.size
    dropped = [FakeCudaArray.from_numpy(values_of(n, rank, salt=n)) for n in (10, 3000, 400_000)]
    for a in dropped:
        fastreduce.iallreduce_(a)  # the request is dropped at once
    gc.collect()
    _engine.wait_idle()
    checks.check(all(np.array_equal(a.to_numpy(), summed(a.size, range(size), salt=a.size))
                     for a in dropped), "dropped requests still deliver")


@pytest.mark.parametrize("n, after, label", [
    pytest.param(1000, 0, "first wait", id="1000-first-wait"),
    pytest.param(600_000, 0, "first wait", id="600000-first-wait"),
    pytest.param(600_000, 10, "half-way", id="600000-half-way"),
    pytest.param(3_000_000, 0, "start", id="3000000-start"),
])
def test_a_failure_inside_the_engine(n, after, label, comm, checks):
    """A CUDA error on the last rank: its wait() raises it, the others' wait() raise that it
    failed elsewhere (no rank hangs); the next request works."""
    rank, size = comm.rank, comm.size
    # 600_000 floats in 64 KiB chunks: 37 chunks, so "half-way" is mid-job; "start": chunks
    # of 1.7 MB, the pinned memory grows, which waits first
    old = _cuda.set_staging_chunk(0 if label == "start" else 64 << 10)
    try:
        g = FakeCudaArray.from_numpy(values_of(n, rank))
        if label != "start":  # pinned memory for this size (growing it waits for the GPU)
            fastreduce.iallreduce_(FakeCudaArray.from_numpy(values_of(n, rank))).wait()
        fakecuda.quiesce()
        if rank == size - 1:  # the engine's wait for a copy in fails, or growing pinned memory
            fakecuda.fail_event_syncs(1, after)
        _cuda.reset_copy_counts()
        req = fastreduce.iallreduce_(g)
        if label == "start" and rank == size - 1:
            checks.check(_cuda.copy_counts()["d2h_copies"] == 0,
                         "the request failed while starting")
        try:
            req.wait()
            message = "no error"
        except RuntimeError as exc:
            message = str(exc)
        fakecuda.fail_event_syncs(0)
        if rank == size - 1:
            checks.check("cudaEventSynchronize failed" in message
                         and "illegal memory access" in message,
                         f"{n} {label}: the failing rank's wait() says why: {message!r}")
        else:
            checks.check("failed on another rank" in message,
                         f"{n} {label}: the others' wait(): {message!r}")
        checks.check(req.done, f"{n} {label}: a failed request is done")
        fakecuda.quiesce()
        g = FakeCudaArray.from_numpy(values_of(n, rank))  # the engine goes on
        checks.check(np.array_equal(fastreduce.iallreduce_(g).wait().to_numpy(),
                                    summed(n, range(size))),
                     f"{n} {label}: the request after a failure")
    finally:
        fakecuda.fail_event_syncs(0)
        _cuda.set_staging_chunk(old)


def test_two_threads_wait_for_one_request(comm, checks):
    """wait() from two threads at once: both return the tensor, reduced."""
    g = FakeCudaArray.from_numpy(values_of(300_000, comm.rank))
    req = fastreduce.iallreduce_(g)
    results = []
    waiter = threading.Thread(target=lambda: results.append(req.wait()))
    waiter.start()
    results.append(req.wait())
    waiter.join()
    checks.check(len(results) == 2 and all(r is g for r in results)
                 and np.array_equal(g.to_numpy(), summed(300_000, range(comm.size))),
                 "two waiters")


def test_host_requests_of_64_KiB_and_more(comms, comm, checks):
    """The engine runs the host requests of 64 KiB and more (the default threshold), on
    every communicator; waited for in reverse, all correct."""
    comms, members = comms
    checks.check(_engine.host_bytes() == 64 << 10,
                 f"default host threshold {_engine.host_bytes()}")
    started = []
    for i, n in enumerate((10, 16383, 16384, 300_000, 5, 2_000_000)):  # float32: 64 KiB = 16384
        for k, c in enumerate(comms):
            h = values_of(n, members[k].index(comm.rank), salt=i)
            req = fastreduce.iallreduce_(h, comm=c)
            checks.check(req.engine == (n * 4 >= 64 << 10), f"host {n} floats: engine {req.engine}")
            started.append((req, h, n, k, i))
    for req, h, n, k, i in reversed(started):  # waited for in reverse, on every rank
        checks.check(req.wait() is h
                     and np.array_equal(h, summed(n, range(len(members[k])), salt=i)),
                     f"host request {i} ({n} floats) on comm {k}")


@pytest.mark.parametrize("setting, small, big", [(False, False, False), (True, True, True),
                                                 (1 << 20, False, True)],
                         ids=["none", "all", "1MiB"])
def test_set_host(setting, small, big, comm, checks):
    """set_host: which host requests (100 and 400_000 floats) the engine runs."""
    _engine.set_host(setting)
    try:
        reqs = [fastreduce.iallreduce(values_of(n, comm.rank)) for n in (100, 400_000)]
        checks.check([r.engine for r in reqs] == [small, big], f"set_host({setting}): {reqs}")
        checks.check(all(np.array_equal(r.wait(), summed(n, range(comm.size)))
                         for r, n in zip(reqs, (100, 400_000), strict=True)),
                     f"set_host({setting})")
    finally:
        _engine.set_host(None)


def test_callbacks(comm, checks):
    """Job.add_done_callback fires once, from the engine (a GPU request), or when a host
    request completes."""
    rank = comm.rank
    seen = []
    gc.collect()  # (freeing device memory waits for the whole device: not from here on)
    stream = Stream()
    g = FakeCudaArray.from_numpy(np.zeros(3000, np.float32), stream=stream)
    g.write(values_of(3000, rank), delay_us=500_000)
    req = fastreduce.iallreduce_(g)
    req.add_done_callback(lambda r: seen.append(("before wait", r is req)))
    checks.check(seen == [], f"a callback fired before the request was done: {seen}")
    req.wait()
    for _ in range(500):  # the engine calls it just after marking the job done
        if seen:
            break
        time.sleep(0.01)
    req.add_done_callback(lambda r: seen.append(("after wait", r is req)))
    checks.check(seen == [("before wait", True), ("after wait", True)], f"callbacks: {seen}")
    h = values_of(5, rank, np.float64)
    req = fastreduce.iallreduce_(h)  # a host request: its callback fires when it completes
    req.add_done_callback(lambda r: seen.append(("host", r.done)))
    req.wait()
    checks.check(seen[-1] == ("host", True), f"host request callback: {seen}")
