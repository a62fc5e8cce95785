"""fastreduce.distdl: DistDL's partition and AllSumReduce API over fastreduce's own classes.

The 12-rank job runs DistDL's 9 AllSumReduce adjoint cases and its ex_all_reduce
example (ported with import changes) in one mpiexec, so the 12-rank start-up is
paid once.
"""

import pytest
from mpirun import run_workers


def test_distdl_port():
    out = run_workers("distdl_adjoint.py", 12, timeout=600)
    assert out.count("Adjoint test:") == 9
    assert "on 12 ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [3, 4])  # grids 1x3 and 2x2
def test_distdl_api(nprocs):
    out = run_workers("distdl_api.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out
