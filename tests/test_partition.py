"""Partitions, the sub-communicator cache, and the seed example at 12 and 13 ranks."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_partitions(nprocs):
    out = run_workers("partitions.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [12, 13])  # 13: one worker is inactive
def test_seed_example(nprocs):
    out = run_workers("seed_example.py", nprocs, timeout=600)
    assert f"on {nprocs} ranks, 0 failed" in out
