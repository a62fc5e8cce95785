"""The multi-rank cases: every rank of `mpiexec -n N python -m pytest tests/mpi` runs
them, under the harness of tests/support/mpi_harness.py (docs/testing.md)."""

import pytest
from mpi_harness import (  # noqa: F401  (the harness's hooks and fixtures, for this folder)
    checks,
    comm,
    pytest_addoption,
    pytest_configure,
    shared_tmp_path,
)


@pytest.fixture(scope="module")
def process_group():
    """torch.distributed's default group on the fastreduce backend for the module: made here
    unless an earlier case left one, and then destroyed at the module's end."""
    import torch.distributed as dist

    import fastreduce.distributed  # noqa: F401  (registers the backend)

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("fastreduce")
    yield
    if made:
        dist.destroy_process_group()
