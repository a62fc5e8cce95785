"""The multi-rank cases: every rank of `mpiexec -n N python -m pytest tests/mpi` runs
them, under the harness of tests/support/mpi_harness.py (docs/testing.md)."""

from mpi_harness import (  # noqa: F401  (the harness's hooks and fixtures, for this folder)
    checks,
    comm,
    pytest_addoption,
    pytest_configure,
    shared_tmp_path,
)
