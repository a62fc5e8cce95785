"""Steady state: in place allocates nothing per call; out of place only the result.

Python-level allocations are counted with tracemalloc, torch's CPU allocator
through torch.profiler's memory events. The GIL is released while a rank waits
in MPI: a Python thread keeps running meanwhile.
"""

from __future__ import annotations

import itertools
import threading
import time
import tracemalloc

import numpy as np
import torch
from common import WORLD, Failures
from torch.profiler import ProfilerActivity, profile

import fastreduce

fails = Failures()
CALLS = 2000


def traced_growth(fn, x) -> int:
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
    fails.check(current - start <= 1024, f"{fn.__name__}: {current - start} B left allocated")
    return peak - start


for name, x, empty_like in [("torch", torch.ones(1024), torch.empty_like),
                            ("numpy", np.ones(1024, np.float32), np.empty_like)]:
    nothing = traced_growth(id, x)
    growth = traced_growth(fastreduce.allreduce_, x) - nothing
    # numpy goes through a __dlpack__ capsule, created and freed within each call
    limit = 0 if name == "torch" else 256
    fails.check(growth <= limit, f"in place on {name}: {growth} B allocated per call")
    result_only = traced_growth(empty_like, x) - nothing
    growth = traced_growth(fastreduce.allreduce, x) - nothing
    fails.check(growth <= result_only + (0 if name == "torch" else 512),
                f"out of place on {name}: {growth} B per call, the result alone is "
                f"{result_only} B")

x = torch.ones(1000)
fastreduce.allreduce_(x)
fastreduce.allreduce(x)
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    for _ in range(50):
        fastreduce.allreduce_(x)
events = [e for e in prof.events() if e.name == "[memory]"]
fails.check(not events, f"in place: torch allocator saw {len(events)} events")
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    for _ in range(50):
        fastreduce.allreduce(x)
sizes = [abs(e.cpu_memory_usage) for e in prof.events() if e.name == "[memory]"]
fails.check(len(sizes) <= 2 * 50 and all(s == x.nbytes for s in sizes),
            f"out of place: torch allocator events {sizes[:6]} (want one {x.nbytes} B block "
            f"per call)")

# The GIL is released while MPI waits: rank 0 enters the all-reduce at once,
# the last rank 0.5 s later; a thread on rank 0 counts meanwhile.
if WORLD.size > 1:
    counter = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1

    WORLD.Barrier()
    if WORLD.rank == 0:
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
        fails.check(waited > 0.3, f"rank 0 did not wait for the late rank ({waited:.3f}s)")
        fails.check(during > 1000, f"a Python thread advanced only {during} steps while "
                                   f"rank 0 waited {waited:.3f}s in MPI: GIL held?")
    else:
        if WORLD.rank == WORLD.size - 1:
            time.sleep(0.5)
        fastreduce.allreduce_(torch.ones(4))
fails.finish()
