"""MPI ending under fastreduce: calls after MPI.Finalize() and an import after it raise a
clear exception (before, the process aborted inside MPI). Launched: finalizing MPI ends
what a process can do with it."""

import os
import subprocess
import sys

import pytest
from mpirun import PROGRAMS, run_mpi


@pytest.mark.parametrize("nprocs", [2, 3])
def test_calls_after_finalize(nprocs):
    """Every call after MPI.Finalize() raises RuntimeError on every rank; the job ends
    normally."""
    rc, out = run_mpi(nprocs, sys.executable, str(PROGRAMS / "after_finalize.py"),
                      timeout=120)
    assert rc == 0, out
    for rank in range(nprocs):
        assert f"rank {rank}: ok" in out, out


def test_import_after_finalize():
    """`import fastreduce` after MPI.Finalize(): ImportError saying so (a singleton job)."""
    done = subprocess.run(
        [sys.executable, "-c", "from mpi4py import MPI; MPI.Finalize(); import fastreduce"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 1, done.stderr
    assert "ImportError: fastreduce: MPI was finalized" in done.stderr, done.stderr
