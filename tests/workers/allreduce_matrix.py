"""Every dtype x op x shape x mode of allreduce/allreduce_ against a numpy reference.

With --segment-bytes N the calls are segmented (N bytes per MPI call): the number of MPI
calls each makes is checked too, and every rank must get bit-identical results.

Usage: allreduce_matrix.py {torch,numpy} [--big] [--count-limit N] [--segment-bytes N]
"""

from __future__ import annotations

import argparse
import math
import zlib

import numpy as np
from common import WORLD, Failures
from reference import FLOATING, ops_for, reduce, tolerance, values

import fastreduce

TORCH_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16",
                "float32", "float64", "complex64", "complex128"]
NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "float16", "float32", "float64", "complex64", "complex128"]
SHAPES = [(), (0,), (1,), (7,), (3, 5, 7), (2, 0, 3)]
MODES = ["in_place", "new", "out"]
DIGESTS: list[tuple[str, int]] = []  # (case, crc32 of the result): the same on every rank


class Framework:
    def __init__(self, name: str) -> None:
        self.name = name
        if name == "torch":
            import torch

            self.torch = torch

    def make(self, vals: np.ndarray, dtype: str):
        """A contiguous tensor of `dtype` holding `vals` (rounded to the dtype)."""
        if self.name == "numpy":
            return np.ascontiguousarray(vals.astype(dtype))
        torch = self.torch
        return torch.from_numpy(np.ascontiguousarray(vals)).to(getattr(torch, dtype))

    def to_numpy(self, t) -> np.ndarray:
        """Exact values of a tensor as numpy (bfloat16 as float32: exact)."""
        if self.name == "numpy":
            return np.asarray(t)
        if t.dtype == self.torch.bfloat16:
            t = t.to(self.torch.float32)
        return t.numpy()

    def wide(self, t) -> np.ndarray:
        """Values widened for a reference computed without intermediate rounding."""
        a = self.to_numpy(t)
        if a.dtype.kind == "f":
            return a.astype(np.float64)
        if a.dtype.kind == "c":
            return a.astype(np.complex128)
        return a

    def empty_like(self, t):
        return np.empty_like(t) if self.name == "numpy" else self.torch.empty_like(t)

    def same_kind(self, a, b) -> bool:
        if type(a) is not type(b) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return False
        return self.name == "numpy" or a.device == b.device


def run_case(fw: Framework, dtype: str, op: str, shape: tuple, mode: str, integral: bool,
             fails: Failures) -> None:
    p, rank = WORLD.size, WORLD.rank
    case = (fw.name, dtype, op, shape, mode, integral)
    tensors = [fw.make(values(dtype, op, shape, r, str(case), integral), dtype) for r in range(p)]
    stack = np.stack([fw.wide(t) for t in tensors]) if p else None
    expected = reduce(stack, op, p)
    x = tensors[rank]
    before = fw.to_numpy(x).copy()
    calls = fastreduce.backend.reduce._mpi_call_count()
    if mode == "in_place":
        result = fastreduce.allreduce_(x, op)
        fails.check(result is x, f"{case}: allreduce_ did not return x")
    elif mode == "new":
        result = fastreduce.allreduce(x, op)
        fails.check(result is not x and fw.same_kind(result, x),
                    f"{case}: result is not a new tensor of x's type, dtype, shape, device")
    else:
        out = fw.empty_like(x)
        result = fastreduce.allreduce(x, op, out=out)
        fails.check(result is out, f"{case}: allreduce(out=) did not return out")
    calls = fastreduce.backend.reduce._mpi_call_count() - calls
    count = int(np.prod(shape, dtype=np.int64))
    steps = expected_steps(count, fw.to_numpy(x).itemsize if dtype != "bfloat16" else 2)
    fails.check(calls in {max(1, math.ceil(count / step)) for step in steps},
                f"{case}: {calls} MPI calls for {count} elements, {steps} per call")
    DIGESTS.append((str(case), zlib.crc32(fw.to_numpy(result).tobytes())))
    if mode != "in_place":
        fails.check(np.array_equal(fw.to_numpy(x), before, equal_nan=True),
                    f"{case}: x was modified by an out-of-place allreduce")
    got = fw.wide(result)
    exact = dtype not in FLOATING or integral or op in ("min", "max")
    if exact:
        want = fw.wide(fw.make(expected, dtype))  # the reference rounded to the dtype once
        fails.check(np.array_equal(got, want),
                    f"{case}: got {got.ravel()[:5]} expected {want.ravel()[:5]}")
    else:
        err = np.abs(got - expected)
        bound = tolerance(dtype, op, stack, p)
        fails.check(bool(np.all(err <= bound)),
                    f"{case}: error {np.max(err, initial=0)} above {np.max(bound, initial=0)}")


def expected_steps(count: int, itemsize: int) -> set[int]:
    """Elements per MPI call: a segment where segmentation applies, else the count limit
    (or, past it, one large-count call where the MPI has them, for MPI's own ops)."""
    limit = fastreduce.backend.reduce._set_count_limit(1)
    fastreduce.backend.reduce._set_count_limit(limit)
    segment = fastreduce.runtime.segment_bytes()
    segment = max(segment // itemsize, 1) if segment else 0
    if segment and count > segment and segment < limit:
        return {segment}
    if count > limit and fastreduce.HAVE_LARGE_COUNT:
        return {count, limit}
    return {limit}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["torch", "numpy"])
    parser.add_argument("--big", action="store_true", help="add tensors over 1 MiB")
    parser.add_argument("--count-limit", type=int, default=0,
                        help="lower the int-count limit to force large-count / chunked calls")
    parser.add_argument("--segment-bytes", type=int, default=-1,
                        help="segment size in bytes (default: fastreduce's)")
    args = parser.parse_args()
    if args.count_limit:
        fastreduce.backend.reduce._set_count_limit(args.count_limit)
    if args.segment_bytes >= 0:
        fastreduce.runtime.set_segment_bytes(args.segment_bytes)
    fw = Framework(args.framework)
    dtypes = TORCH_DTYPES if fw.name == "torch" else NUMPY_DTYPES
    fails = Failures()
    for dtype in dtypes:
        shapes = list(SHAPES)
        if args.big:
            shapes = [((1 << 20) // 2 + 3,)]  # over 1 MiB for every dtype of 2 bytes and up
        for op in ops_for(dtype):
            if args.big and op not in ("sum", "max", "bxor", "bor"):
                continue
            for shape in shapes:
                for mode in MODES:
                    integral_options = [True, False] if dtype in FLOATING else [True]
                    for integral in integral_options:
                        fails.run(f"{fw.name} {dtype} {op} {shape} {mode} integral={integral}",
                                  run_case, fw, dtype, op, shape, mode, integral, fails)
    everyone = WORLD.allgather(DIGESTS)
    fails.check(all(d == DIGESTS for d in everyone),
                "results differ between ranks: " + str(next(
                    (a, b) for d in everyone for a, b in zip(d, DIGESTS, strict=False) if a != b)
                    if any(d != DIGESTS for d in everyone) else ""))
    fails.finish()


if __name__ == "__main__":
    main()
