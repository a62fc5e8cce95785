"""AllSumReduce and AllReduce: values, adjoint tests, gradcheck, 5000 layers, bad input."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_autograd_layers(nprocs):
    out = run_workers("autograd_layers.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_compiled_layers(nprocs):
    """torch.compile(fullgraph=True) over the layers and ops: no graph breaks, eager's
    results, dynamic shapes, adjoint, no recompilation, guards on communicators."""
    out = run_workers("compiled_layers.py", nprocs, timeout=600)
    assert f"on {nprocs} ranks, 0 failed" in out
