"""fastreduce.horovod's DistributedOptimizer, broadcast helpers and SyncBatchNorm against
single-process torch on the batches of all ranks."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_horovod_training(nprocs):
    out = run_workers("horovod_training.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
