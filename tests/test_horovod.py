"""fastreduce.horovod's collectives, set-up, process sets, join, timeline and errors."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_horovod_ops(nprocs):
    out = run_workers("horovod_ops.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
