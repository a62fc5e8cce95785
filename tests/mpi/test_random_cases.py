"""A randomised differential test: hundreds of random all-reduces (shape, dtype, op, in place
or not, blocking or not, torch or numpy, world / split / Cartesian sub-communicator), each
against numpy's reduction of the inputs gathered from every rank. Seeded and reproducible:
a failure names its case, its seed and its parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import matches, ops_for, reduce, values

import fastreduce

pytestmark = pytest.mark.mpi(ranks=3)

DTYPES = ["float64", "float32", "float16", "bfloat16", "complex64", "int8", "int16", "int32",
          "int64", "uint8", "bool"]
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool}


@pytest.fixture(scope="module")
def communicators(comm):
    """The communicators cases draw from: the world, a split and a Cartesian sub (its
    partition kept alive meanwhile: freeing a partition frees its subs)."""
    p, rank = comm.size, comm.rank
    partition = fastreduce.Partition().create_cartesian_topology_partition([p, 1])
    yield {"world": fastreduce.default_comm(), "split": comm.Split(rank % 2, rank),
            "cartesian sub": partition.sub([0])}


def as_input(data, dtype: str, lib: str):
    data = np.asarray(data)  # a 0-d array, not a numpy scalar, for shape ()
    if lib == "numpy":
        return np.array(data, dtype=dtype)
    t = torch.from_numpy(np.ascontiguousarray(data))
    return t.to(TORCH.get(dtype, getattr(torch, dtype, None)))


def as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return (x.to(torch.float64) if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


def run_case(k: int, rng: np.random.Generator, seed: int, comms: dict, rank: int,
             f) -> None:
    dtype = str(rng.choice(DTYPES))
    op = str(rng.choice(ops_for(dtype)))
    ndim = int(rng.integers(0, 4))
    shape = tuple(int(n) for n in rng.integers(0, 7, ndim))
    if rng.random() < 0.1:
        shape = (int(rng.integers(1000, 300_000)),)  # over the segment and pipeline sizes
    lib = "torch" if dtype == "bfloat16" else str(rng.choice(["torch", "numpy"]))
    form = str(rng.choice(["allreduce_", "allreduce", "iallreduce_", "iallreduce"]))
    comm_name = str(rng.choice(list(comms)))
    comm = comms[comm_name]
    case_seed = int(rng.integers(0, 2**31))
    label = (f"case {k} (seed {seed}): {form} {op} {dtype} {shape} {lib} over {comm_name} "
             f"of {comm.Get_size()}")
    x = as_input(values(dtype, op, shape, rank, case_seed, integral=False), dtype, lib)
    kept = as_numpy(x).copy()
    if form == "allreduce_":
        got = fastreduce.allreduce_(x, op, comm=comm)
    elif form == "allreduce":
        got = fastreduce.allreduce(x, op, comm=comm)
    elif form == "iallreduce_":
        got = fastreduce.iallreduce_(x, op, comm=comm).wait()
    else:
        got = fastreduce.iallreduce(x, op, comm=comm).wait()
    if form in ("allreduce", "iallreduce"):
        f.check(np.array_equal(as_numpy(x), kept, equal_nan=True), f"{label}: input changed")
    inputs = comm.allgather(kept)  # every rank's input, exactly as it was passed
    n = comm.Get_size()
    stack = np.stack(inputs)
    if dtype in ("float16", "bfloat16"):
        stack = stack.astype(np.float64 if dtype == "bfloat16" else np.float32)
    want = reduce(stack, op, n)
    result = as_numpy(got)
    f.check(matches(result, want, dtype, op, stack, n),
            f"{label}: got {result.ravel()[:4]} want {want.ravel()[:4]}")


@pytest.mark.parametrize("seed", [2026, 7])
def test_random_cases(checks, comm, communicators, seed):
    """300 random all-reduces at 3 ranks against numpy's reduction of the gathered inputs
    (rerun a failing seed with: mpiexec -n 3 python -m pytest
    tests/mpi/test_random_cases.py -k SEED)."""
    rng = np.random.default_rng(seed)  # the same choices on every rank
    for k in range(300):
        checks.run(f"case {k}", run_case, k, rng, seed, communicators, comm.rank, checks)
