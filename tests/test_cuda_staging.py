"""The GPU paths, on CPU-only machines: over the fake CUDA runtime of tests/fakecuda."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_gpu_paths_over_fake_runtime(fake_cuda, nprocs):
    out = run_workers("cuda_staging.py", nprocs, timeout=600)
    assert f"on {nprocs} ranks, 0 failed" in out
