"""Which GPU path each call takes (direct or staged), what each MPI promises, the settings
and the calibration: over the fake CUDA runtime and a fake MPI layer that records the kind of
memory every all-reduce is handed (tests/fakempi)."""

import pytest
from mpirun import run_workers


def test_capability_table_and_settings():
    out = run_workers("gpupath_settings.py", 1)
    assert "on 1 ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_path_choice_over_fake_cuda_and_mpi(fake_cuda, nprocs):
    out = run_workers("gpu_paths.py", nprocs, timeout=600)
    assert f"on {nprocs} ranks, 0 failed" in out
