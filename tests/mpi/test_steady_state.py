"""Steady state: no allocations per in-place call, only the result out of place; the GIL
released while a rank waits in MPI; out-of-place results above 128 KiB from a cache of the
blocks freed results gave back.

Python-level allocations are counted with tracemalloc, torch's CPU allocator through
torch.profiler's memory events.
"""

from __future__ import annotations

import itertools
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fastreduce

pytestmark = pytest.mark.mpi(ranks=2)
CALLS = 2000


def traced_growth(checks, fn, x) -> int:
    """Peak bytes tracemalloc saw above the start while calling fn(x) CALLS times.

    A per-call allocation shows as a peak above that of a function that
    allocates nothing (id), measured the same way; it does not grow with CALLS
    when it is freed in the same call.
    """
    fn(x)  # warm caches (per-type lookups, the default communicator)
    tracemalloc.start()
    tracemalloc.reset_peak()
    start, _ = tracemalloc.get_traced_memory()
    for _ in itertools.repeat(None, CALLS):
        fn(x)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    checks.check(current - start <= 1024, f"{fn.__name__}: {current - start} B left allocated")
    return peak - start


def least_growth(checks, fn, x, tries: int = 3) -> int:
    """The least of `tries` traced_growth measurements: tracemalloc sees every thread, and
    another one's allocation (torch's, the interpreter's) may land in one window; a
    per-call allocation is in each."""
    return min(traced_growth(checks, fn, x) for _ in range(tries))


@pytest.mark.parametrize(("name", "x", "empty_like"), [
    ("torch", torch.ones(1024), torch.empty_like),
    ("numpy", np.ones(1024, np.float32), np.empty_like),
], ids=["torch", "numpy"])
def test_python_allocations(checks, name, x, empty_like):
    """tracemalloc: nothing allocated per in-place call, only the result out of place."""
    nothing = least_growth(checks, id, x)
    growth = least_growth(checks, fastreduce.allreduce_, x) - nothing
    # numpy goes through a __dlpack__ capsule, created and freed within each call
    limit = 0 if name == "torch" else 256
    checks.check(growth <= limit, f"in place on {name}: {growth} B allocated per call")
    result_only = least_growth(checks, empty_like, x) - nothing
    growth = least_growth(checks, fastreduce.allreduce, x) - nothing
    checks.check(growth <= result_only + (0 if name == "torch" else 512),
                 f"out of place on {name}: {growth} B per call, the result alone is "
                 f"{result_only} B")


def test_torch_allocator(checks):
    """torch's allocator sees no event in place, one result-sized block out of place."""
    x = torch.ones(1000)
    fastreduce.allreduce_(x)
    fastreduce.allreduce(x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(50):
            fastreduce.allreduce_(x)
    events = [e for e in prof.events() if e.name == "[memory]"]
    checks.check(not events, f"in place: torch allocator saw {len(events)} events")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(50):
            fastreduce.allreduce(x)
    sizes = [abs(e.cpu_memory_usage) for e in prof.events() if e.name == "[memory]"]
    checks.check(len(sizes) <= 2 * 50 and all(s == x.nbytes for s in sizes),
                 f"out of place: torch allocator events {sizes[:6]} (want one {x.nbytes} B "
                 f"block per call)")


def test_gil_released_in_mpi(checks, comm):
    """The GIL is released while MPI waits: rank 0 enters the all-reduce at once, the last
    rank 0.5 s later; a thread on rank 0 counts meanwhile."""
    counter = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1

    comm.Barrier()
    if comm.rank == 0:
        thread = threading.Thread(target=count)
        thread.start()
        time.sleep(0.05)
        before = counter[0]
        t0 = time.perf_counter()
        fastreduce.allreduce_(torch.ones(4))
        waited = time.perf_counter() - t0
        during = counter[0] - before
        stop.set()
        thread.join()
        checks.check(waited > 0.3, f"rank 0 did not wait for the late rank ({waited:.3f}s)")
        checks.check(during > 1000, f"a Python thread advanced only {during} steps while "
                                    f"rank 0 waited {waited:.3f}s in MPI: GIL held?")
    else:
        if comm.rank == comm.size - 1:
            time.sleep(0.5)
        fastreduce.allreduce_(torch.ones(4))


# -- the result cache ------------------------------------------------------------------

@pytest.fixture
def result_cache():
    """fastreduce.result_cache_info, the cache emptied first (by a zero limit, restored)
    so that no block an earlier case freed is handed out."""
    fastreduce.set_result_cache_limit(fastreduce.set_result_cache_limit(0))
    return fastreduce.result_cache_info


@pytest.fixture
def pooled(comm):
    """(x, want): a 400 KB input, pooled out of place, and its all-reduce."""
    p = comm.size
    x = torch.arange(100_000, dtype=torch.float32).reshape(4, 25_000) + comm.rank
    want = p * torch.arange(100_000, dtype=torch.float32).reshape(4, 25_000) + sum(range(p))
    return x, want


def test_result_cache_reuse(checks, result_cache, pooled):
    """Out-of-place results above 128 KiB: a fresh block for each live result, a freed
    result's block handed out again."""
    info, (x, want) = result_cache, pooled
    start = info()
    first = fastreduce.allreduce(x)
    checks.check(torch.equal(first, want), "pooled result value")
    checks.check(first.shape == x.shape and first.stride() == x.stride()
                 and first.is_contiguous(),
                 f"pooled result layout {first.shape} {first.stride()}")
    second = fastreduce.allreduce(x)
    checks.check(first.data_ptr() != second.data_ptr(), "two live results share memory")
    second.add_(1)
    checks.check(torch.equal(first, want), "writing one result changed another")
    address = first.data_ptr()
    del first
    third = fastreduce.allreduce(x)
    checks.check(third.data_ptr() == address, "a freed result's block was not reused")
    checks.check(info()["hits"] >= start["hits"] + 1, f"no cache hit recorded: {info()}")


def test_result_cache_freed_on_a_thread(checks, result_cache, pooled):
    """Results freed on another thread give their blocks back safely."""
    info, (x, _) = result_cache, pooled
    results = [fastreduce.allreduce(x) for _ in range(8)]
    thread = threading.Thread(target=results.clear)
    thread.start()
    thread.join()
    checks.check(info()["cached"] >= 8 * x.nbytes,
                 f"blocks freed on a thread not cached: {info()}")


def test_result_cache_zero_limit(checks, result_cache, pooled):
    """A zero limit frees what is cached and keeps nothing."""
    info, (x, _) = result_cache, pooled
    kept = fastreduce.allreduce(x)
    fastreduce.allreduce(x)  # freed at once: a cached block
    old = fastreduce.set_result_cache_limit(0)
    try:
        checks.check(info()["cached"] == 0, f"cache not emptied: {info()}")
        del kept
        checks.check(info()["cached"] == 0, f"cached above the limit: {info()}")
    finally:
        fastreduce.set_result_cache_limit(old)


def test_result_cache_small_results(checks, comm):
    """Small results are ordinary framework allocations."""
    small = fastreduce.allreduce(torch.ones(10))
    checks.check(torch.equal(small, torch.full((10,), float(comm.size))), "small result")
