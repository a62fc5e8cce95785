"""AllSumReduce and AllReduce: values, adjoint tests, gradcheck, 5000 layers, bad input."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_autograd_layers(nprocs):
    out = run_workers("autograd_layers.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
