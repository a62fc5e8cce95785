"""The all-reduce algorithms (mpi, ring, rsag, hierarchical), compression, auto's choice.

tools/test.sh runs test_algorithms[4] again on 2 nodes x 2 ranks, [3] on 2 nodes of 2 and
1 ranks, and on 3 nodes x 1 rank (fastreduce.cluster), where auto picks the network
algorithms and hierarchical has leaders and node communicators to use.
"""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_algorithms(nprocs):
    args = ("--quick",) if nprocs in (1, 4) else ()
    out = run_workers("algorithms.py", nprocs, *args)
    assert f"on {nprocs} ranks, 0 failed" in out
