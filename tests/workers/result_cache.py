"""Out-of-place results above 128 KiB come from a cache of blocks freed results gave back."""

from __future__ import annotations

import threading

import torch
from common import WORLD, Failures

import fastreduce

fails = Failures()
p = WORLD.size
x = torch.arange(100_000, dtype=torch.float32).reshape(4, 25_000) + WORLD.rank
want = p * torch.arange(100_000, dtype=torch.float32).reshape(4, 25_000) + sum(range(p))
info = fastreduce.result_cache_info
start = info()

first = fastreduce.allreduce(x)
fails.check(torch.equal(first, want), "pooled result value")
fails.check(first.shape == x.shape and first.stride() == x.stride() and first.is_contiguous(),
            f"pooled result layout {first.shape} {first.stride()}")
second = fastreduce.allreduce(x)
fails.check(first.data_ptr() != second.data_ptr(), "two live results share memory")
second.add_(1)
fails.check(torch.equal(first, want), "writing one result changed another")
address = first.data_ptr()
del first
third = fastreduce.allreduce(x)
fails.check(third.data_ptr() == address, "a freed result's block was not reused")
fails.check(info()["hits"] >= start["hits"] + 1, f"no cache hit recorded: {info()}")

# results freed on another thread give their blocks back safely
results = [fastreduce.allreduce(x) for _ in range(8)]
thread = threading.Thread(target=results.clear)
thread.start()
thread.join()
fails.check(info()["cached"] >= 8 * x.nbytes, f"blocks freed on a thread not cached: {info()}")

# a zero limit frees what is cached and keeps nothing
old = fastreduce.set_result_cache_limit(0)
fails.check(info()["cached"] == 0, f"cache not emptied: {info()}")
del third
fails.check(info()["cached"] == 0, f"cached above the limit: {info()}")
fastreduce.set_result_cache_limit(old)

# small results are ordinary framework allocations
small = fastreduce.allreduce(torch.ones(10))
fails.check(torch.equal(small, torch.full((10,), float(p))), "small result")
fails.finish()
