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


@pytest.fixture
def count_limit(request):
    """The int-count limit lowered to the case's parameter (elements per int-count MPI
    call), restored after (test_allreduce.py, test_movement.py)."""
    import fastreduce.backend.reduce

    old = fastreduce.backend.reduce._set_count_limit(request.param)
    yield request.param
    fastreduce.backend.reduce._set_count_limit(old)


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
