"""MPI ending under fastreduce: calls after MPI.Finalize() and an import after it raise a
clear exception (before, the process aborted inside MPI). Launched: finalizing MPI ends
what a process can do with it."""

import os
import subprocess
import sys

from mpirun import PROGRAMS, run_mpi


def test_calls_after_finalize():
    """Every call after MPI.Finalize() raises RuntimeError on every rank; the job ends
    normally."""
    rc, out = run_mpi(2, sys.executable, str(PROGRAMS / "after_finalize.py"), timeout=120)
    assert rc == 0, out
    assert "rank 0: ok" in out and "rank 1: ok" in out, out


def test_import_after_finalize():
    """`import fastreduce` after MPI.Finalize(): ImportError saying so (a singleton job)."""
    done = subprocess.run(
        [sys.executable, "-c", "from mpi4py import MPI; MPI.Finalize(); import fastreduce"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 1, done.stderr
    assert "ImportError: fastreduce: MPI was finalized" in done.stderr, done.stderr
