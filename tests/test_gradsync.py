"""GradientSync against the one-by-one reference; accumulation; refused misuse; bad input."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_gradient_sync(nprocs):
    out = run_workers("gradient_sync.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
