"""Node-local rank and the CUDA-aware answer, under mpiexec."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 3])
def test_launcher_agnostic_core(nprocs):
    out = run_workers("launcher_agnostic.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


def test_cuda_aware_settings():
    out = run_workers("runtime_settings.py", 1)
    assert "on 1 ranks, 0 failed" in out
