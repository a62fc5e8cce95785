"""Shared by every test: tests/support on the path, and tests/mpi left out of a run that
does not name it (its cases run on every rank of an MPI job: `mpiexec -n N python -m
pytest tests/mpi`, docs/testing.md)."""

import os
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).parent / "support"
sys.path.insert(0, str(SUPPORT))

MPI_CASES = Path(__file__).parent / "mpi"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config):
    """tests/mpi only when named: a single-process run must not initialise MPI itself."""
    if collection_path == MPI_CASES:
        named = (Path(a.split("::")[0]).resolve() for a in config.args)
        if not any(p == MPI_CASES or MPI_CASES in p.parents for p in named):
            return True
    return None


@pytest.fixture
def fake_cuda(monkeypatch):
    """Launched programs load the fake CUDA runtime (tests/support/fakecuda), with no GPU
    setting inherited."""
    import profiles

    for variable in profiles.CLEARED:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in profiles.environment("fakecuda").items():
        monkeypatch.setenv(variable, value)


# The longest files of tests/launch (minutes each, launched jobs), in the order two
# pytest-xdist workers should start them (tools/test.sh: a file to a worker, in collection
# order): the longest first, so that none is left running alone at the end.
LONGEST_FILES = ("test_slurm.py", "test_tools.py", "test_wheel.py", "test_watchdog.py",
                 "test_cluster.py", "test_node_failures.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` run only when selected (pytest -m long): CI stays short. Under
    pytest-xdist, the longest files first."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        first = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable
    if "long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="a long run: select it with pytest -m long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
