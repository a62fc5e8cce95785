"""AllSumReduce and AllReduce: values, adjoint tests, gradcheck, 5000 layers, bad input."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_autograd_layers(nprocs):
    out = run_workers("autograd_layers.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


def _traceable() -> bool:
    import fastreduce.ops

    return fastreduce.ops.TRACEABLE


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_compiled_layers(nprocs):
    """torch.compile(fullgraph=True) over the layers and ops: no graph breaks, eager's
    results, dynamic shapes, adjoint, no recompilation, guards on communicators."""
    if not _traceable():
        pytest.skip("torch older than 2.12 does not trace fastreduce's ops (documented); "
                    "test_compiled_fallback checks what it does instead")
    out = run_workers("compiled_layers.py", nprocs, timeout=600)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [2])
def test_compiled_fallback(nprocs):
    """torch.compile without fullgraph gives eager's results on every torch (traced, or with
    graph breaks around the layers on torch older than 2.12)."""
    out = run_workers("compiled_fallback.py", nprocs, timeout=600)
    assert f"on {nprocs} ranks, 0 failed" in out
    assert f"traced through the custom ops: {_traceable()}" in out
