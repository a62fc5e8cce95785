"""The benchmark's buffers and its correctness check: each rank's inputs and the expected
all-reduce of them."""

from __future__ import annotations

import numpy as np

ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "complex64": 8,
            "complex128": 16, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1,
            "bool": 1}
DTYPES = tuple(ITEMSIZE)
OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")


def make_buffer(kind: str, dtype: str, count: int, device: str = "cpu"):
    """A zeroed numpy array or torch tensor of count elements."""
    if kind == "numpy":
        return np.zeros(count, dtype=dtype)
    import torch  # optional and heavy: loaded only when used

    return torch.zeros(count, dtype=getattr(torch, dtype), device=device)


def fill(buf, values: np.ndarray) -> None:
    """Copy values into buf, converted to its dtype."""
    if isinstance(buf, np.ndarray):
        buf[:] = values.astype(buf.dtype)
    else:
        import torch  # optional and heavy: loaded only when used

        buf.copy_(torch.from_numpy(values).to(buf.dtype))


def as_numpy(buf) -> np.ndarray:
    """buf as a host numpy array (bfloat16 widened to float32)."""
    if isinstance(buf, np.ndarray):
        return buf
    import torch  # optional and heavy: loaded only when used

    if buf.dtype == torch.bfloat16:
        buf = buf.float()
    return buf.cpu().numpy()


def rank_values(dtype: str, op: str, rank: int, count: int) -> np.ndarray:
    """Small, exactly representable inputs of one rank for the correctness check."""
    if dtype == "bool":
        return (np.arange(count) + rank) % 3 != 0
    if op in ("band", "bor", "bxor"):
        return ((np.arange(count) + rank) % 7 + 1).astype(np.int64)
    if op == "prod":
        return np.where((np.arange(count) + rank) % 5 == 0, 2.0, 1.0)
    return ((np.arange(count) + rank) % 4 + 1).astype(np.float64)


def expected(dtype: str, op: str, size: int, count: int) -> np.ndarray:
    """The all-reduce of `rank_values` over size ranks, in float64 (bool for bool)."""
    stack = np.stack([rank_values(dtype, op, r, count) for r in range(size)])
    if op in ("sum", "avg"):
        out = stack.sum(axis=0)
        return out / size if op == "avg" else out
    if op == "prod":
        return stack.prod(axis=0)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    logical = stack.dtype == bool
    fn = {"band": np.logical_and if logical else np.bitwise_and,
          "bor": np.logical_or if logical else np.bitwise_or,
          "bxor": np.logical_xor if logical else np.bitwise_xor}[op]
    return fn.reduce(stack, axis=0)


def _rounded(buffers: str, dtype: str, values: np.ndarray):
    buf = make_buffer(buffers, dtype, values.size)  # rounding as on the host
    fill(buf, values)
    return buf
