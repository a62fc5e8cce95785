"""FASTREDUCE_TIMEOUT's watchdog ends a hung job: a rank that never arrives, and the others'
watchdog prints the flight record (the stuck collective marked) and aborts the job. A
launched program (tests/launch/programs/timeout.py): what it checks is the job's end.

Across the nodes of a test cluster: FASTREDUCE_TEST_NODES=2 (mpirun places the ranks)."""

import sys
import time

import pytest
from mpirun import PROGRAMS, run_mpi


@pytest.mark.parametrize("nprocs", [2, 4])
def test_timeout_ends_a_hung_job(monkeypatch, nprocs):
    """FASTREDUCE_TIMEOUT=5 and a rank 60 s late: the job ends well before 40 s, with the
    stuck all-reduce and the flight record on stderr."""
    monkeypatch.setenv("FASTREDUCE_TIMEOUT", "5")
    start = time.monotonic()
    rc, out = run_mpi(nprocs, sys.executable, str(PROGRAMS / "timeout.py"), "60", timeout=90)
    elapsed = time.monotonic() - start
    assert rc != 0 and elapsed < 40, (rc, elapsed, out)
    assert "allreduce_" in out and "has not completed in 5 s" in out, out
    assert "flight record" in out and ">>" in out and "count 1000" in out, out
    assert "not reached" not in out, out


# The records made in Python (an agreement, the node's split) once; those made by the
# compiled core (the default communicator's dup, Horovod's round) on both MPIs.
@pytest.mark.parametrize(("where", "names"), [
    ("first-allreduce", "MPI_Comm_dup: the default communicator"),
    pytest.param("partition", "agreement on create_cartesian_topology_partition",
                 marks=pytest.mark.one_mpi),
    pytest.param("local-rank", "MPI_Comm_split_type: the node's ranks", marks=pytest.mark.one_mpi),
    ("horovod", "fastreduce.horovod: a round of the matching by name"),
])
def test_timeout_sees_the_first_collective(monkeypatch, where, names):
    """A rank that never reaches the first collective (it failed while loading data): the
    set-up collectives (the default communicator made, an agreement, the node's split,
    fastreduce.horovod's matching of requests by name) are in the flight record, so the
    watchdog ends the job within the timeout and names them."""
    monkeypatch.setenv("FASTREDUCE_TIMEOUT", "3")
    start = time.monotonic()
    rc, out = run_mpi(3, sys.executable, str(PROGRAMS / "timeout.py"), "60", where, timeout=90)
    elapsed = time.monotonic() - start
    assert rc != 0 and elapsed < 35, (rc, elapsed, out)
    assert "has not completed in 3 s" in out and names in out, out
    assert "flight record" in out and ">>" in out and "set-up" in out, out
    assert "not reached" not in out, out


@pytest.mark.one_mpi  # the bound is the Python core's; the abort path runs on both above
@pytest.mark.parametrize(("where", "names"), [
    ("torch-group", "allreduce_"),
    ("torch-group-async", "allgather"),
])
def test_group_timeout_ends_a_hung_job(monkeypatch, where, names):
    """A torch.distributed group's timeout (3 s) bounds its operations with the process's
    timeout off (FASTREDUCE_TIMEOUT=0): a rank 60 s late, the others' watchdog prints the
    record naming the group's timeout and ends the job, for a blocking operation and for one
    the progress engine runs on its duplicate of the group's communicator."""
    monkeypatch.setenv("FASTREDUCE_TIMEOUT", "0")
    start = time.monotonic()
    rc, out = run_mpi(2, sys.executable, str(PROGRAMS / "timeout.py"), "60", where, "3",
                      timeout=90)
    elapsed = time.monotonic() - start
    assert rc != 0 and elapsed < 40, (rc, elapsed, out)
    assert "has not completed in 3 s (the group's timeout" in out and names in out, out
    assert "flight record" in out and ">>" in out, out
    assert "not reached" not in out, out
