"""Shared by every test: tests/support on the path, and tests/mpi left out of a run that
does not name it (its cases run on every rank of an MPI job: `mpiexec -n N python -m
pytest tests/mpi`, docs/testing.md)."""

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


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` run only when selected (pytest -m long): CI stays short."""
    if "long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="a long run: select it with pytest -m long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
