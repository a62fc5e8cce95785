"""Misuse across ranks: set-up calls made differently raise on every rank (never a crash or
a hang); inactive sub-partitions are inactive."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_setup_disagreement_and_inactive_workers(nprocs):
    out = run_workers("misuse.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
