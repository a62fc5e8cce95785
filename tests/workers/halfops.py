"""16-bit float reductions against numpy/torch references, over many bit patterns.

Run with FASTREDUCE_HALF_OPS=fastreduce to check fastreduce's own ops, and
without it to check whatever path this MPI uses. Every result must equal the
correctly rounded float32 result of the two operands (what IEEE arithmetic in
the 16-bit type gives), NaN for NaN.
"""

from __future__ import annotations

import numpy as np
import torch
from common import Failures

import fastreduce
from fastreduce.backend import reductions
from fastreduce.backend.collectives import _reduce_local

fails = Failures()
rng = np.random.default_rng(2024)
bits = np.arange(1 << 16, dtype=np.uint16)  # every 16-bit pattern as the left operand
partner = rng.integers(0, 1 << 16, bits.size, dtype=np.uint16)
# operands of similar magnitude exercise rounding more than random exponents do
close = (bits ^ rng.integers(0, 1 << 6, bits.size, dtype=np.uint16)).astype(np.uint16)

REF = {"sum": np.add, "prod": np.multiply, "min": np.fmin, "max": np.fmax}


def same(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got == want) | (np.isnan(got) & np.isnan(want))


def check(dtype: str, op: str, a_bits: np.ndarray, b_bits: np.ndarray) -> None:
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
    fails.check(not bad.any(), f"{dtype} {op}: {bad.sum()} of {bad.size} differ, e.g. "
                               f"got {got[bad][:3]} want {want[bad][:3]}")


print("paths:", fastreduce.half_precision_paths())
print("mpi types:", reductions.mpi_half_types())
for dtype in ("float16", "bfloat16"):
    for op in ("sum", "prod", "min", "max"):
        check(dtype, op, bits, partner)
        check(dtype, op, bits, close)
fails.finish()
