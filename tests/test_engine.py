"""The progress engine (non-blocking staged GPU and large host requests), over the fake
CUDA runtime."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_engine(fake_cuda, nprocs):
    out = run_workers("engine.py", nprocs, timeout=600)
    assert f"on {nprocs} ranks, 0 failed" in out


def test_requests_pending_at_exit_are_delivered(fake_cuda):
    out = run_workers("engine.py", 3, "--exit-pending", timeout=300)
    assert out.count("delivered at exit: True") == 3, out
    assert out.count("request after the engine stopped: True") == 3, out


def test_gpu_paths_without_the_engine(fake_cuda, monkeypatch):
    """FASTREDUCE_ENGINE=0: non-blocking GPU calls keep to MPI's non-blocking collectives."""
    monkeypatch.setenv("FASTREDUCE_ENGINE", "0")
    out = run_workers("cuda_staging.py", 2, timeout=600)
    assert "on 2 ranks, 0 failed" in out
