"""The torch.distributed backend: every operation against a reference and gloo, groups,
DDP/FSDP2/ZeRO/checkpoint training equal to gloo, the tutorials' programs."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_every_operation(nprocs):
    out = run_workers("torch_backend.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


def test_every_operation_without_the_engine(monkeypatch):
    """Non-blocking operations run at once when the progress engine is off: same answers."""
    monkeypatch.setenv("FASTREDUCE_ENGINE", "0")
    out = run_workers("torch_backend.py", 3)
    assert "on 3 ranks, 0 failed" in out


def test_every_operation_through_the_engine(monkeypatch):
    """Every non-blocking operation, however small, on the progress engine."""
    monkeypatch.setenv("FASTREDUCE_ENGINE_HOST_BYTES", "0")
    out = run_workers("torch_backend.py", 3)
    assert "on 3 ranks, 0 failed" in out
