"""Cases that misbehave on purpose, for tests/launch/test_harness.py (never collected on
their own: their names do not start with test_)."""

from mpi_harness import (  # noqa: F401  (the harness's hooks and fixtures, for this folder)
    checks,
    comm,
    pytest_addoption,
    pytest_configure,
    shared_tmp_path,
)
