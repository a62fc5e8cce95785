"""Run from a merged wheel (tools/wheel.sh): the build for the MPI that mpi4py loaded is
the one in use, and the core's all-reduce (above the int count limit too), all-gather and
broadcast give the right data;
so do a request the progress engine runs and, with torch installed, the torch.distributed
backend and Horovod's API. argv[1]: the variant expected ("openmpi" or "mpich"); run with
FASTREDUCE_ENGINE_HOST_BYTES=0 (every non-blocking host request on the engine)."""

import importlib.util
import sys

import numpy as np
from mpi4py import MPI

import fastreduce
from fastreduce.backend import collectives, engine, reduce, variants

rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
want = sys.argv[1]
assert variants.in_use().startswith(f"the wheel's {want} build"), variants.in_use()
assert f"/backend/_{want}/" in collectives.__file__, collectives.__file__
x = np.full(5, rank + 1.0, np.float32)
fastreduce.allreduce_(x)
assert x.tolist() == [size * (size + 1) / 2] * 5, x
g = fastreduce.allgather(np.full(3, float(rank), np.float64))
assert g.tolist() == [float(r) for r in range(size) for _ in range(3)], g
b = np.arange(4, dtype=np.int32) * (rank + 1)
fastreduce.broadcast_(b, size - 1)
assert b.tolist() == [i * size for i in range(4)], b
# above the int count limit (lowered to 5 here): one MPI_Allreduce_c where the MPI loaded
# has it (looked up at run time), else chunks
limit = reduce._set_count_limit(5)
try:
    z = np.full(100, rank + 1, np.int32)
    before = reduce._mpi_call_count()
    fastreduce.allreduce_(z)
    calls = reduce._mpi_call_count() - before
finally:
    reduce._set_count_limit(limit)
assert z.tolist() == [size * (size + 1) // 2] * 100, z[:3]
assert calls == (1 if fastreduce.HAVE_LARGE_COUNT else 20), calls  # the path taken
large = "MPI_Allreduce_c" if calls == 1 else "chunked"
cases = ["core"]

if engine.state()[0]:  # MPI_THREAD_MULTIPLE: the engine's thread and its duplicate
    y = np.full(1000, rank + 1.0, np.float64)
    request = fastreduce.iallreduce_(y)
    assert request.wait() is y and y.tolist() == [size * (size + 1) / 2] * 1000, y[:3]
    cases.append("engine")

if importlib.util.find_spec("torch") is not None:
    import torch
    import torch.distributed as dist

    import fastreduce.distributed  # noqa: F401  (registers the backend)
    import fastreduce.horovod as hvd

    dist.init_process_group("fastreduce")
    t = torch.full((6,), float(rank))
    dist.all_reduce(t)
    gathered = torch.empty(6 * size)
    dist.all_gather_into_tensor(gathered, torch.full((6,), float(rank)))
    assert t.tolist() == [sum(range(size))] * 6 and \
        gathered.tolist() == [float(r) for r in range(size) for _ in range(6)], (t, gathered)
    dist.barrier()
    dist.destroy_process_group()
    cases.append("backend")

    hvd.init()
    s = hvd.allreduce(torch.full((4,), float(rank)), op=hvd.Sum)
    h = hvd.broadcast(torch.full((3,), float(rank)), root_rank=0)
    assert s.tolist() == [sum(range(size))] * 4 and h.tolist() == [0.0] * 3, (s, h)
    hvd.shutdown()
    cases.append("horovod")

print(f"rank {rank}: {variants.in_use()}, {size} ranks, large counts: {large}, "
      f"{'+'.join(cases)}: ok", flush=True)
