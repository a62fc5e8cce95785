"""The progress engine, over the fake CUDA runtime: non-blocking staged GPU requests and
host requests of 64 KiB and more.

  start       starting a request does not wait for the GPU: the producer's delayed write
              is still pending when iallreduce_ returns, and is what gets reduced
  in flight   many requests on several communicators, waited for in another order on
              every rank (and with test() and wait_all), all correct
  dropped     requests dropped without wait() still complete, buffers kept until then
  failures    a CUDA error on one rank, when the job starts, half-way through it, or while
              starting the request: that rank's wait() raises it, the others' wait() raise
              that it failed elsewhere (no rank hangs); the next requests work
  callbacks   Job.add_done_callback fires once, from the engine

Usage: engine.py [--exit-pending]   (the latter: start requests and exit without waiting;
                                     an atexit hook checks they were delivered)
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading
import time

EXIT_CHECKS = []  # --exit-pending: run at exit after fastreduce's own handlers
atexit.register(lambda: [check() for check in EXIT_CHECKS])  # before fastreduce registers

import fakecuda  # noqa: E402
import numpy as np  # noqa: E402
from common import WORLD, Failures  # noqa: E402
from fakecuda import FakeCudaArray, Stream  # noqa: E402

import fastreduce  # noqa: E402
from fastreduce.backend import cudart as _cuda  # noqa: E402
from fastreduce.backend import engine as _engine  # noqa: E402

fails = Failures()
check = fails.check
rank, size = WORLD.rank, WORLD.size
fastreduce.set_cuda_aware(False)


def values_of(n: int, r: int, dtype=np.float32, salt: int = 0) -> np.ndarray:
    return ((np.arange(n) * 7 + r * 3 + salt) % 5 + 1).astype(dtype)


def summed(n: int, ranks, dtype=np.float32, salt: int = 0) -> np.ndarray:
    return sum(values_of(n, r, dtype, salt).astype(np.float64) for r in ranks).astype(dtype)


if "--exit-pending" in sys.argv:
    # requests started and never waited for; interpreter exit must deliver them (atexit
    # handlers run last-registered first: EXIT_CHECKS run after fastreduce's own)
    arrays = [FakeCudaArray.from_numpy(values_of(n, rank, salt=n)) for n in (10, 3000, 300_000)]
    requests = [fastreduce.iallreduce_(a) for a in arrays]
    dropped = [FakeCudaArray.from_numpy(values_of(n, rank, salt=n)) for n in (20, 200_000)]
    for a in dropped:
        fastreduce.iallreduce_(a)  # dropped at once, still pending at exit
    arrays += dropped

    def delivered():
        ok = all(np.array_equal(a.to_numpy(), summed(a.size, range(size), salt=a.size))
                 for a in arrays)
        print(f"[rank {rank}] delivered at exit: {ok}", flush=True)

    EXIT_CHECKS.append(delivered)

    def late_request():  # after the engine stopped: it runs in this thread
        late = FakeCudaArray.from_numpy(values_of(5000, rank))
        ok = np.array_equal(fastreduce.iallreduce_(late).wait().to_numpy(),
                            summed(5000, range(size)))
        print(f"[rank {rank}] request after the engine stopped: {ok}", flush=True)

    EXIT_CHECKS.append(late_request)
    print(f"[rank {rank}] started {len(requests)} requests, exiting", flush=True)
    sys.exit(0)

check(_engine.state()[0], f"the engine runs here: {_engine.state()}")

# --- start: no host wait for the GPU ------------------------------------------------------
for n in (1000, 600_000):  # whole, and pipelined in chunks
    # (growing the pinned memory frees the old block, which waits for the whole device:
    # warm up first, as in a training loop's steady state)
    fastreduce.iallreduce_(FakeCudaArray.from_numpy(values_of(n, rank))).wait()
    # (and free the last iteration's arrays now: cudaFree waits for the whole device)
    req = g = result = None
    gc.collect()
    stream = Stream()
    g = FakeCudaArray.from_numpy(np.zeros(n, np.float32), stream=stream)
    g.write(values_of(n, rank), delay_us=2_000_000)  # the producer's kernel, still running
    req = fastreduce.iallreduce_(g)
    check(not stream.query(), f"{n}: iallreduce_ waited on the host for the producer's stream")
    check(req.wait() is g and np.array_equal(g.to_numpy(), summed(n, range(size))),
          f"{n}: the delayed write is what got reduced")
    _cuda._set_skip_waits(True)  # without the engine's waits for the copies in: stale data
    g = FakeCudaArray.from_numpy(np.zeros(n, np.float32), stream=stream)
    g.write(values_of(n, rank), delay_us=300_000)
    result = fastreduce.iallreduce_(g).wait().to_numpy()
    _cuda._set_skip_waits(False)
    if size > 1:
        check(not np.array_equal(result, summed(n, range(size))),
              f"{n}: the ordering check cannot fail")
    fakecuda.quiesce()

# --- many requests in flight on several communicators --------------------------------------
comms = [fastreduce.default_comm(), WORLD.Dup()]
if size > 1:
    comms.append(WORLD.Split(rank % 2, rank))
members = [list(range(size)), list(range(size))]
if size > 1:
    members.append([r for r in range(size) if r % 2 == rank % 2])
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
    check(got is g and np.array_equal(g.to_numpy(), want), f"request {i} on comm {k}")
    check(req.done and req.wait() is g, f"request {i}: done, and a second wait returns it")

# out of place, and wait_all mixing host and GPU requests
g = FakeCudaArray.from_numpy(values_of(5000, rank))
h = values_of(7, rank, np.float64)
results = fastreduce.wait_all([fastreduce.iallreduce(g), fastreduce.iallreduce_(h),
                               fastreduce.iallreduce(g, "max")])
check(np.array_equal(results[0].to_numpy(), summed(5000, range(size)))
      and np.array_equal(results[1], summed(7, range(size), np.float64))
      and np.array_equal(results[2].to_numpy(), values_of(5000, rank).copy() * 0 + np.max(
          [values_of(5000, r) for r in range(size)], axis=0))
      and np.array_equal(g.to_numpy(), values_of(5000, rank)), "wait_all, out of place")

# --- dropped requests -----------------------------------------------------------------------
dropped = [FakeCudaArray.from_numpy(values_of(n, rank, salt=n)) for n in (10, 3000, 400_000)]
for a in dropped:
    fastreduce.iallreduce_(a)  # the request is dropped at once
gc.collect()
_engine.wait_idle()
check(all(np.array_equal(a.to_numpy(), summed(a.size, range(size), salt=a.size))
          for a in dropped), "dropped requests still deliver")

# --- failures inside the engine ---------------------------------------------------------------
_cuda.set_staging_chunk(64 << 10)  # 600_000 floats: 37 chunks, so "half-way" is mid-job
for n, after, label in ((1000, 0, "first wait"), (600_000, 0, "first wait"),
                        (600_000, 10, "half-way"), (3_000_000, 0, "start")):
    if label == "start":  # chunks of 1.7 MB: the pinned memory grows, which waits first
        _cuda.set_staging_chunk(0)
    g = FakeCudaArray.from_numpy(values_of(n, rank))
    if label != "start":  # pinned memory for this size (growing it waits for the GPU)
        fastreduce.iallreduce_(FakeCudaArray.from_numpy(values_of(n, rank))).wait()
    fakecuda.quiesce()
    if rank == size - 1:  # the engine's wait for a copy in fails, or growing pinned memory
        fakecuda.fail_event_syncs(1, after)
    _cuda.reset_copy_counts()
    req = fastreduce.iallreduce_(g)
    if label == "start" and rank == size - 1:
        check(_cuda.copy_counts()["d2h_copies"] == 0, "the request failed while starting")
    try:
        req.wait()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    fakecuda.fail_event_syncs(0)
    if rank == size - 1:
        check("cudaEventSynchronize failed" in message and "illegal memory access" in message,
              f"{n} {label}: the failing rank's wait() says why: {message!r}")
    else:
        check("failed on another rank" in message,
              f"{n} {label}: the others' wait(): {message!r}")
    check(req.done, f"{n} {label}: a failed request is done")
    fakecuda.quiesce()
    g = FakeCudaArray.from_numpy(values_of(n, rank))  # the engine goes on
    check(np.array_equal(fastreduce.iallreduce_(g).wait().to_numpy(), summed(n, range(size))),
          f"{n} {label}: the request after a failure")
_cuda.set_staging_chunk(0)

# --- two threads waiting for one request --------------------------------------------------------
g = FakeCudaArray.from_numpy(values_of(300_000, rank))
req = fastreduce.iallreduce_(g)
results = []
waiter = threading.Thread(target=lambda: results.append(req.wait()))
waiter.start()
results.append(req.wait())
waiter.join()
check(len(results) == 2 and all(r is g for r in results)
      and np.array_equal(g.to_numpy(), summed(300_000, range(size))), "two waiters")

# --- host requests: the engine runs those of 64 KiB and more -------------------------------
check(_engine.host_bytes() == 64 << 10, f"default host threshold {_engine.host_bytes()}")
started = []
for i, n in enumerate((10, 16383, 16384, 300_000, 5, 2_000_000)):  # float32: 64 KiB = 16384
    for k, comm in enumerate(comms):
        h = values_of(n, members[k].index(rank), salt=i)
        req = fastreduce.iallreduce_(h, comm=comm)
        check(req.engine == (n * 4 >= 64 << 10), f"host {n} floats: engine {req.engine}")
        started.append((req, h, n, k, i))
for req, h, n, k, i in reversed(started):  # waited for in reverse, on every rank
    check(req.wait() is h and np.array_equal(h, summed(n, range(len(members[k])), salt=i)),
          f"host request {i} ({n} floats) on comm {k}")
for setting, small, big in ((False, False, False), (True, True, True), (1 << 20, False, True)):
    _engine.set_host(setting)
    reqs = [fastreduce.iallreduce(values_of(n, rank)) for n in (100, 400_000)]
    check([r.engine for r in reqs] == [small, big], f"set_host({setting}): {reqs}")
    check(all(np.array_equal(r.wait(), summed(n, range(size)))
              for r, n in zip(reqs, (100, 400_000), strict=True)), f"set_host({setting})")
_engine.set_host(None)

# --- callbacks --------------------------------------------------------------------------------
seen = []
req = g = None  # (freeing device memory waits for the whole device: not from here on)
gc.collect()
stream = Stream()
g = FakeCudaArray.from_numpy(np.zeros(3000, np.float32), stream=stream)
g.write(values_of(3000, rank), delay_us=2_000_000)
req = fastreduce.iallreduce_(g)
req.add_done_callback(lambda r: seen.append(("before wait", r is req)))
check(seen == [], f"a callback fired before the request was done: {seen}")
req.wait()
for _ in range(500):  # the engine calls it just after marking the job done
    if seen:
        break
    time.sleep(0.01)
req.add_done_callback(lambda r: seen.append(("after wait", r is req)))
check(seen == [("before wait", True), ("after wait", True)], f"callbacks: {seen}")
h = values_of(5, rank, np.float64)
req = fastreduce.iallreduce_(h)  # a host request: its callback fires when it completes
req.add_done_callback(lambda r: seen.append(("host", r.done)))
req.wait()
check(seen[-1] == ("host", True), f"host request callback: {seen}")

for comm in comms[1:]:
    comm.Free()  # their engine duplicates are freed after their jobs
_engine.wait_idle()
fakecuda.quiesce()
fails.finish()
