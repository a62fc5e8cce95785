"""GradientSync against the one-by-one reference; accumulation; refused misuse; bad input."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_gradient_sync(nprocs):
    out = run_workers("gradient_sync.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("engine_host_bytes", ["0", "off"])
def test_gradient_sync_with_and_without_the_engine(monkeypatch, engine_host_bytes):
    """Every bucket through the progress engine (0), and none (off): the same gradients."""
    monkeypatch.setenv("FASTREDUCE_ENGINE_HOST_BYTES", engine_host_bytes)
    out = run_workers("gradient_sync.py", 3)
    assert "on 3 ranks, 0 failed" in out
