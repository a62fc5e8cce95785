"""Inputs seeded per rank and the reductions they must give, computed with numpy.

Every rank regenerates the inputs of all ranks from (case, rank) seeds, so the
expected result of a reduction is known everywhere without communication.
"""

from __future__ import annotations

import zlib

import numpy as np

FLOAT_EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24,
             "float64": 2.0**-53, "complex64": 2.0**-24, "complex128": 2.0**-53}
FLOATING = set(FLOAT_EPS)
INTEGER = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def ops_for(dtype: str) -> list[str]:
    if dtype == "bool":
        return ["band", "bor", "bxor", "min", "max"]
    if dtype in INTEGER:
        return ["sum", "prod", "min", "max", "band", "bor", "bxor"]
    if dtype.startswith("complex"):
        return ["sum", "prod", "avg"]
    return ["sum", "prod", "min", "max", "avg"]


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def values(dtype: str, op: str, shape: tuple, rank: int, case: str, integral: bool):
    """float64 / int64 / complex128 / bool values for one rank (before dtype rounding)."""
    rng = np.random.default_rng(seed(case, rank))
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype in INTEGER:
        info = np.iinfo(dtype)
        if op in ("band", "bor", "bxor"):
            return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
        low, high = (-3, 3) if op == "prod" else (-20, 20)
        if info.min == 0:
            low, high = 0, high
        return rng.integers(low, high, shape, endpoint=True).astype(dtype)
    if integral:
        bound = 3 if op == "prod" else 8
        real = rng.integers(-bound, bound, shape, endpoint=True).astype(np.float64)
        imag = rng.integers(-bound, bound, shape, endpoint=True).astype(np.float64)
    elif op == "prod":
        real, imag = rng.uniform(0.5, 1.5, shape), rng.uniform(-0.5, 0.5, shape)
    else:
        real, imag = rng.uniform(-1, 1, shape), rng.uniform(-1, 1, shape)
    return real + 1j * imag if dtype.startswith("complex") else real


def reduce(stack: np.ndarray, op: str, nranks: int) -> np.ndarray:
    """The reduction of stacked per-rank values (axis 0), in the values' own dtype."""
    if op in ("sum", "avg"):
        out = stack.sum(axis=0, dtype=stack.dtype)
        if op == "avg":
            if out.dtype.kind == "c":  # component-wise, as fastreduce divides
                quotient = np.empty_like(out)
                quotient.real, quotient.imag = out.real / nranks, out.imag / nranks
                return quotient
            return out / nranks
        return out
    if op == "prod":
        return stack.prod(axis=0, dtype=stack.dtype)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    fn = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    if stack.dtype == bool:
        fn = {"band": np.logical_and, "bor": np.logical_or, "bxor": np.logical_xor}[op]
    return fn.reduce(stack, axis=0)


def tolerance(dtype: str, op: str, stack: np.ndarray, nranks: int) -> np.ndarray | float:
    """Largest error allowed for a reduction of inexact float inputs.

    Each of the p-1 combining steps rounds once to the dtype (relative error
    eps), so the bound is about (p-1) * eps * sum|x| for sums and
    (p-1) * eps * |prod| for products, plus one rounding of the result and of
    the division for avg. 2x headroom on top.
    """
    eps = FLOAT_EPS[dtype]
    if op in ("sum", "avg"):
        scale = np.abs(stack).sum(axis=0) / (nranks if op == "avg" else 1)
    else:
        scale = np.abs(stack.prod(axis=0))
    return 2 * (nranks + 1) * eps * scale + np.finfo(np.float64).tiny


def matches(result: np.ndarray, want: np.ndarray, dtype: str, op: str, stack: np.ndarray,
            nranks: int) -> bool:
    """Whether a reduction's result equals `want`: within tolerance() for inexact float
    sums, averages and products, exactly otherwise; the same shape either way."""
    result = np.asarray(result)
    if dtype in ("float16", "bfloat16"):
        result = result.astype(want.dtype)
    if result.shape != want.shape:
        return False
    if dtype in FLOAT_EPS and op in ("sum", "avg", "prod"):
        bound = tolerance(dtype, op, stack.astype(np.complex128 if dtype.startswith("complex")
                                                  else np.float64), nranks)
        return bool(np.all(np.abs(result - want) <= bound))
    return np.array_equal(result, want)
