"""float16 / bfloat16 reductions, bit pattern by bit pattern, on each available path.

Each FASTREDUCE_HALF_OPS setting is a session of its own (fastreduce reads it at import):
auto (the default profile), fastreduce (profile half-ops-fastreduce) and mpi (profile
half-ops-mpi, on Open MPI only). Every result must equal the correctly rounded float32
result of the two operands (what IEEE arithmetic in the 16-bit type gives), NaN for NaN.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

# Asking an MPICH-family MPI about its 16-bit types may abort the process (at fastreduce's
# import, with FASTREDUCE_HALF_OPS=mpi): there the mpi setting is a skipped case of the
# default session, so no session starts with that profile.
OPEN_MPI = "Open MPI" in MPI.Get_library_version()
SETTINGS = [
    pytest.param("auto", marks=pytest.mark.mpi(ranks=1), id="auto"),
    pytest.param("fastreduce", marks=pytest.mark.mpi(ranks=1, profile="half-ops-fastreduce"),
                 id="fastreduce"),
    pytest.param("mpi", id="mpi", marks=[
        pytest.mark.mpi(ranks=1, profile="half-ops-mpi" if OPEN_MPI else "default"),
        pytest.mark.skipif(not OPEN_MPI, reason="asking an MPICH-family MPI about 16-bit "
                                                "types may abort the process")]),
]

rng = np.random.default_rng(2024)
BITS = np.arange(1 << 16, dtype=np.uint16)  # every 16-bit pattern as the left operand
PARTNERS = {
    "random": rng.integers(0, 1 << 16, BITS.size, dtype=np.uint16),
    # operands of similar magnitude exercise rounding more than random exponents do
    "close": (BITS ^ rng.integers(0, 1 << 6, BITS.size, dtype=np.uint16)).astype(np.uint16),
}
REF = {"sum": np.add, "prod": np.multiply, "min": np.fmin, "max": np.fmax}


@pytest.fixture
def session_setting(setting):
    """Check that this session runs with `setting` (its profile's FASTREDUCE_HALF_OPS)."""
    found = os.environ.get("FASTREDUCE_HALF_OPS", "auto")
    assert found == setting, f"the session's FASTREDUCE_HALF_OPS is {found!r}, not {setting!r}"
    return setting


def same(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got == want) | (np.isnan(got) & np.isnan(want))


def check(checks, dtype: str, op: str, a_bits: np.ndarray, b_bits: np.ndarray) -> None:
    from fastreduce.backend.collectives import _reduce_local

    if dtype == "float16":
        a, b = a_bits.view(np.float16), b_bits.view(np.float16)
        with np.errstate(all="ignore"):
            want = REF[op](a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
        out = b.copy()
        _reduce_local(a, out, op)
        got, want = out.astype(np.float32), want.astype(np.float32)
    else:
        a = torch.from_numpy(a_bits.view(np.int16)).view(torch.bfloat16)
        b = torch.from_numpy(b_bits.view(np.int16)).view(torch.bfloat16)
        fn = {"sum": torch.add, "prod": torch.mul, "min": torch.fmin, "max": torch.fmax}[op]
        want = fn(a.float(), b.float()).to(torch.bfloat16).float().numpy()
        out = b.clone()
        _reduce_local(a, out, op)
        got = out.float().numpy()
    if op in ("min", "max"):
        # fmin/fmax drop one NaN; MPI min/max may keep it: compare where neither is NaN
        keep = ~(np.isnan(a.astype(np.float32) if dtype == "float16" else a.float().numpy())
                 | np.isnan(b.astype(np.float32) if dtype == "float16" else b.float().numpy()))
        got, want = got[keep], want[keep]
    bad = ~same(got, want)
    checks.check(not bad.any(), f"{dtype} {op}: {bad.sum()} of {bad.size} differ, e.g. "
                                f"got {got[bad][:3]} want {want[bad][:3]}")


@pytest.mark.parametrize("op", list(REF))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_half_precision_ops(checks, session_setting, dtype, op):
    """Every 16-bit pattern against a random partner and a close one."""
    for partner in PARTNERS.values():
        check(checks, dtype, op, BITS, partner)


@pytest.mark.parametrize("setting", SETTINGS)
def test_half_precision_paths(session_setting):
    """Which path each setting takes: the MPI's float16 type only when asked for and the
    MPI has one (Open MPI's MPIX_C_FLOAT16, 5.x with the shortfloat extension, reduces
    correctly), else fastreduce's own op."""
    import fastreduce
    from fastreduce.backend import reductions

    paths = str(fastreduce.half_precision_paths())
    has_float16 = reductions.mpi_half_types()["float16"]
    if session_setting == "mpi" and has_float16:
        assert "MPIX_C_FLOAT16" in paths, paths
    elif session_setting != "mpi":
        assert "MPIX" not in paths, paths
    else:  # asked, but the MPI has no float16 type: fastreduce's own op stays
        assert "MPIX_C_FLOAT16" not in paths, paths
