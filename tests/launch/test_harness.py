"""The harness of tests/mpi (tests/support/mpi_harness.py), on cases that misbehave on
purpose: one rank's failure fails the case on every rank, names the rank and the command
that runs it again; a hung case ends the job within its timeout and names itself; ranks
that collected different cases stop before running any."""

import sys
import time
from pathlib import Path

from mpirun import run_mpi

CASES = Path(__file__).parent / "harness_cases"
PYTEST = (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA")


def test_a_failure_on_one_rank_fails_everywhere_naming_it():
    rc, out = run_mpi(3, *PYTEST, str(CASES / "misbehaving.py"), "-k", "not forever",
                      timeout=120)
    assert rc == 1, out
    assert "failed on rank(s) 1 of 3" in out and "rank 1 says no" in out, out
    assert "run it again: mpiexec -n 3 python -m pytest" in out, out
    assert "misbehaving.py::test_fails_on_rank_1" in out, out
    # the other cases ran and passed, on every rank, after the failure
    assert "PASSED" in out and "2 passed" in out and "1 failed" in out, out
    # rank 0 alone reports: one summary line, not three
    assert out.count("short test summary info") == 1, out


def test_a_hung_case_fails_within_its_timeout_naming_itself():
    start = time.monotonic()
    rc, out = run_mpi(2, *PYTEST, str(CASES / "misbehaving.py"), "-o", "timeout=5",
                      timeout=120)
    elapsed = time.monotonic() - start
    assert rc != 0, out
    assert elapsed < 60, (elapsed, out)
    assert "TIMEOUT" in out and "test_rank_0_waits_forever did not finish in 5 s" in out, out
    assert "run it again: mpiexec -n 2 python -m pytest" in out, out
    assert "short test summary info" not in out, out  # the job ended at the hang


def test_ranks_that_collect_different_cases_stop_before_running():
    rc, out = run_mpi(2, *PYTEST, str(CASES / "rank_dependent.py"), timeout=120)
    assert rc != 0, out
    assert "the ranks collected different cases" in out, out
    assert "PASSED" not in out, out
