"""Misuse across ranks: set-up calls made differently raise on every rank (never a crash or
a hang); inactive sub-partitions are inactive."""

import sys
from pathlib import Path

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_setup_disagreement_and_inactive_workers(nprocs):
    out = run_workers("misuse.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_debug_mode(monkeypatch, nprocs):
    """FASTREDUCE_DEBUG=1: different counts, dtypes, ops, a skipped call, blocking against
    non-blocking, in the core, the layers and the torch backend: CollectiveMismatch
    everywhere."""
    monkeypatch.setenv("FASTREDUCE_DEBUG", "1")
    out = run_workers("debug_mode.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_debug_mode_sees_different_orders(monkeypatch, nprocs):
    """FASTREDUCE_DEBUG=1: all-reduces on two communicators in different orders (a deadlock)
    raise the same CollectiveMismatch on every rank within seconds; a late rank and a chain
    of waits that resolves do not."""
    monkeypatch.setenv("FASTREDUCE_DEBUG", "1")
    out = run_workers("debug_order.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_timeout_ends_a_hung_job(monkeypatch, nprocs):
    """FASTREDUCE_TIMEOUT=5 and a rank 60 s late: the job ends well before 40 s, with the
    stuck all-reduce and the flight record on stderr."""
    import time

    from mpirun import WORKERS, run_mpi

    monkeypatch.setenv("FASTREDUCE_TIMEOUT", "5")
    start = time.monotonic()
    rc, out = run_mpi(nprocs, sys.executable, str(WORKERS / "timeout.py"), "60", timeout=90)
    elapsed = time.monotonic() - start
    assert rc != 0 and elapsed < 40, (rc, elapsed, out)
    assert "allreduce_" in out and "has not completed in 5 s" in out, out
    assert "flight record" in out and ">>" in out and "count 1000" in out, out
    assert "not reached" not in out, out


@pytest.mark.parametrize(("where", "names"), [
    ("first-allreduce", "MPI_Comm_dup: the default communicator"),
    ("partition", "agreement on create_cartesian_topology_partition"),
    ("local-rank", "MPI_Comm_split_type: the node's ranks"),
])
def test_timeout_sees_the_first_collective(monkeypatch, where, names):
    """A rank that never reaches the first collective (it failed while loading data): the
    set-up collectives (the default communicator made, an agreement, the node's split) are
    in the flight record, so the watchdog ends the job within the timeout and names them."""
    import time

    from mpirun import WORKERS, run_mpi

    monkeypatch.setenv("FASTREDUCE_TIMEOUT", "3")
    start = time.monotonic()
    rc, out = run_mpi(3, sys.executable, str(WORKERS / "timeout.py"), "60", where, timeout=90)
    elapsed = time.monotonic() - start
    assert rc != 0 and elapsed < 35, (rc, elapsed, out)
    assert "has not completed in 3 s" in out and names in out, out
    assert "flight record" in out and ">>" in out and "set-up" in out, out
    assert "not reached" not in out, out


@pytest.mark.parametrize("nprocs", [1, 3])
def test_flight_record(nprocs):
    """With a timeout set, the record holds the core's calls, coalesced calls and the
    backend's collectives and point-to-point calls, in order, done or started."""
    out = run_workers("flight_record.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("seed", [2026, 7])
def test_random_cases(seed):
    """300 random all-reduces at 3 ranks against numpy's reduction of the gathered inputs
    (rerun a failing case with: mpiexec -n 3 python -m mpi4py tests/workers/random_cases.py
    SEED 300)."""
    out = run_workers("random_cases.py", 3, str(seed), "300")
    assert "on 3 ranks, 0 failed" in out


def test_soak_without_leaks(tmp_path):
    """bench/soak_bench.py at half scale: 2500 partitions and layers made and dropped (MPICH
    has about 2048 communicators: a leak fails here), 50k small, 5k out-of-place and 5k
    non-blocking calls, 500 GradientSync steps, with bounded memory growth."""
    import json

    from mpirun import run_mpi

    bench = Path(__file__).resolve().parents[1] / "bench" / "soak_bench.py"
    result = tmp_path / "soak.json"
    rc, out = run_mpi(2, sys.executable, str(bench), "--scale", "0.5", "--json", str(result))
    assert rc == 0, out
    growth = {k: v["rss_growth_kib"] for k, v in json.loads(result.read_text()).items()}
    assert growth["partitions"] < 4096 and all(g < 16384 for g in growth.values()), growth
