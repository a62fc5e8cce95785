"""Bad input: a clear exception on the calling rank, nothing modified, no hang."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_bad_input(nprocs):
    out = run_workers("bad_input.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
