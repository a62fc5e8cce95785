"""float16 / bfloat16 reductions, bit pattern by bit pattern, on each available path."""

import os

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("setting", ["auto", "fastreduce"])
def test_half_precision_ops(setting, monkeypatch):
    monkeypatch.setitem(os.environ, "FASTREDUCE_HALF_OPS", setting)
    out = run_workers("halfops.py", 1)
    assert "on 1 ranks, 0 failed" in out
    if setting == "fastreduce":
        assert "MPIX" not in out.split("paths:")[1].splitlines()[0]
