"""The multi-rank cases: every rank of `mpiexec -n N python -m pytest tests/mpi` runs
them, under the harness of tests/support/mpi_harness.py."""

from pathlib import Path

import mpi_harness
import pytest
from checks import Checks
from mpi4py import MPI


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mpi", "multi-rank cases (tests/support/mpi_harness.py)")
    group.addoption("--profile", default="default",
                    help="the environment of this session (tests/support/profiles.py); "
                         "cases of other profiles are deselected")
    group.addoption("--mpi-sessions", action="store_true",
                    help="print the [ranks, profile] sessions the collected cases need, "
                         "as JSON, and exit")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi(ranks=(1, 2, 3, 4), profile='default'): the rank "
                                       "counts and profile a multi-rank case runs with")
    config.addinivalue_line("markers", "across_nodes: also run in the passes across nodes")
    mpi_harness.apply_profile(config.getoption("profile"))
    config.pluginmanager.register(mpi_harness.MPIHarness(config), "mpi_harness")


@pytest.fixture
def checks() -> Checks:
    """Soft checks: a failure is recorded and the case goes on to its next collective; the
    case fails after it returns, on every rank, with each rank's failures."""
    return Checks()


@pytest.fixture(scope="session")
def comm() -> MPI.Intracomm:
    """MPI.COMM_WORLD: every rank of the session."""
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp_path(tmp_path: Path) -> Path:
    """Rank 0's new tmp_path, the same directory on every rank (the nodes of a test
    cluster share this machine's file system)."""
    return Path(MPI.COMM_WORLD.bcast(str(tmp_path)))
