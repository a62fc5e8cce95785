"""iallreduce / iallreduce_ / wait_all / Request lifetime, and allreduce_coalesced_."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_nonblocking_and_coalesced(nprocs):
    out = run_workers("nonblocking.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
