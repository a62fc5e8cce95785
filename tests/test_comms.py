"""Communicators, MPI.Op arguments and MPI-reported errors."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_communicators(nprocs):
    out = run_workers("comms.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
