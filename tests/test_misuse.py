"""Misuse across ranks: set-up calls made differently raise on every rank (never a crash or
a hang); inactive sub-partitions are inactive."""

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
