"""float16 / bfloat16 reductions, bit pattern by bit pattern, on each available path."""

import os

import pytest
from mpirun import mpi_family, run_workers


@pytest.mark.parametrize("setting", ["auto", "fastreduce", "mpi"])
def test_half_precision_ops(setting, monkeypatch):
    if setting == "mpi" and mpi_family() != "Open MPI":
        pytest.skip("asking an MPICH-family MPI about 16-bit types may abort the process")
    monkeypatch.setitem(os.environ, "FASTREDUCE_HALF_OPS", setting)
    out = run_workers("halfops.py", 1)
    assert "on 1 ranks, 0 failed" in out
    paths = out.split("paths:")[1].splitlines()[0]
    has_float16 = "'float16': True" in out.split("mpi types:")[1].splitlines()[0]
    if setting == "mpi" and has_float16:
        # Open MPI's MPIX_C_FLOAT16 (5.x with the shortfloat extension) reduces correctly
        assert "MPIX_C_FLOAT16" in paths, paths
    elif setting != "mpi":
        assert "MPIX" not in paths, paths
    else:  # asked, but the MPI has no float16 type: fastreduce's own op stays
        assert "MPIX_C_FLOAT16" not in paths, paths
