"""Every tensor torch (or numpy) can make reduces right or is refused by name."""

import os

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_tensor_semantics(nprocs):
    """Lazy conjugate and negative views, wait_all([r, r]), storage swapped under a
    request, and the refusals, each as it once went wrong."""
    out = run_workers("tensor_semantics.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize(("nprocs", "seed"), [(2, 2026), (3, 7)])
def test_tensor_properties_differential(nprocs, seed):
    """300 random cases over tensor properties x dtypes x ops x entry points x
    communicators against numpy's reduction of every rank's logical input (rerun a failing
    case with: mpiexec -n 3 python -m mpi4py tests/workers/tensor_properties.py SEED 300)."""
    out = run_workers("tensor_properties.py", nprocs, str(seed), "300")
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.long
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_tensor_properties_long(nprocs):
    """The long run (marker `long`): 3000 cases per rank count, the seed from
    FASTREDUCE_TEST_SEED (default 1)."""
    seed = os.environ.get("FASTREDUCE_TEST_SEED", "1")
    out = run_workers("tensor_properties.py", nprocs, seed, "3000", timeout=1200)
    assert f"on {nprocs} ranks, 0 failed" in out
