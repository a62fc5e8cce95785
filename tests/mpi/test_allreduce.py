"""allreduce / allreduce_ on 1-4 ranks: every dtype x op x shape x mode, torch and numpy,
against a numpy reference (from 3 ranks each (dtype, op) in one mode, in turn: `cases`).

A case is one (framework, dtype, op, mode); it runs every shape (and, for floating
dtypes, integral and non-integral values). Each call's number of MPI calls is checked
against the count limit and the segment size in force (the `count_limit` and
`segment_bytes` fixtures lower them), and every rank must get bit-identical results.
"""

from __future__ import annotations

import functools
import math
import zlib

import numpy as np
import pytest
from mpi4py import MPI
from reference import FLOATING, ops_for, reduce, tolerance, values

import fastreduce

TORCH_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16",
                "float32", "float64", "complex64", "complex128"]
NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "float16", "float32", "float64", "complex64", "complex128"]
DTYPES = {"torch": TORCH_DTYPES, "numpy": NUMPY_DTYPES}
SHAPES = [(), (0,), (1,), (7,), (3, 5, 7), (2, 0, 3)]
BIG_SHAPES = [((1 << 20) // 2 + 3,)]  # over 1 MiB for every dtype of 2 bytes and up
BIG_OPS = ("sum", "max", "bxor", "bor")
MODES = ["in_place", "new", "out"]
CASE = "framework, dtype, op, mode"


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


@functools.cache
def get_framework(name: str) -> Framework:
    return Framework(name)


def cases(frameworks=("torch", "numpy"), big: bool = False) -> list:
    """The (framework, dtype, op, mode) cases, with ids like torch-float32-sum-in_place;
    over 1 MiB (`big`) only the ops sum, max, bxor and bor.

    On 1 and 2 ranks every mode of every (framework, dtype, op). From 3 ranks one mode each,
    in turn: the mode (where the result goes) and the framework (how DLPack hands the
    memory over) are handled before any MPI call, the same at every size, while what 3 or
    4 ranks change (MPI's algorithm, the number of terms of each element) is the dtype and
    the op's; every mode still meets every framework and dtype there."""
    every_mode = MPI.COMM_WORLD.size <= 2
    params = []
    for fw in frameworks:
        turn = 0
        for dtype in DTYPES[fw]:
            for op in ops_for(dtype):
                if big and op not in BIG_OPS:
                    continue
                modes = MODES if every_mode else [MODES[turn % len(MODES)]]
                turn += 1
                params += [pytest.param(fw, dtype, op, mode, id=f"{fw}-{dtype}-{op}-{mode}")
                           for mode in modes]
    return params


@pytest.fixture
def segment_bytes(request):
    """The segment size pinned to the case's parameter (bytes per MPI call; 0: off),
    restored after."""
    old = fastreduce.runtime.set_segment_bytes(request.param)
    yield request.param
    fastreduce.runtime.set_segment_bytes(old)


def run_case(fw: Framework, dtype: str, op: str, shape: tuple, mode: str, integral: bool,
             checks, digests: list) -> None:
    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    case = (fw.name, dtype, op, shape, mode, integral)
    tensors = [fw.make(values(dtype, op, shape, r, str(case), integral), dtype) for r in range(p)]
    stack = np.stack([fw.wide(t) for t in tensors]) if p else None
    expected = reduce(stack, op, p)
    x = tensors[rank]
    before = fw.to_numpy(x).copy()
    calls = fastreduce.backend.reduce._mpi_call_count()
    if mode == "in_place":
        result = fastreduce.allreduce_(x, op)
        checks.check(result is x, f"{case}: allreduce_ did not return x")
    elif mode == "new":
        result = fastreduce.allreduce(x, op)
        checks.check(result is not x and fw.same_kind(result, x),
                     f"{case}: result is not a new tensor of x's type, dtype, shape, device")
    else:
        out = fw.empty_like(x)
        result = fastreduce.allreduce(x, op, out=out)
        checks.check(result is out, f"{case}: allreduce(out=) did not return out")
    calls = fastreduce.backend.reduce._mpi_call_count() - calls
    count = int(np.prod(shape, dtype=np.int64))
    steps = expected_steps(count, fw.to_numpy(x).itemsize if dtype != "bfloat16" else 2)
    checks.check(calls in {max(1, math.ceil(count / step)) for step in steps},
                 f"{case}: {calls} MPI calls for {count} elements, {steps} per call")
    digests.append((str(case), zlib.crc32(fw.to_numpy(result).tobytes())))
    if mode != "in_place":
        checks.check(np.array_equal(fw.to_numpy(x), before, equal_nan=True),
                     f"{case}: x was modified by an out-of-place allreduce")
    got = fw.wide(result)
    exact = dtype not in FLOATING or integral or op in ("min", "max")
    if exact:
        want = fw.wide(fw.make(expected, dtype))  # the reference rounded to the dtype once
        checks.check(np.array_equal(got, want),
                     f"{case}: got {got.ravel()[:5]} expected {want.ravel()[:5]}")
    else:
        err = np.abs(got - expected)
        bound = tolerance(dtype, op, stack, p)
        checks.check(bool(np.all(err <= bound)),
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


def run_matrix(name: str, dtype: str, op: str, mode: str, checks, comm,
               shapes=SHAPES) -> None:
    """Every shape (and integral or not, for floating dtypes) of one case; then the
    results must be bit-identical on every rank."""
    fw = get_framework(name)
    digests: list[tuple[str, int]] = []  # (case, crc32 of the result): the same everywhere
    for shape in shapes:
        for integral in ([True, False] if dtype in FLOATING else [True]):
            checks.run(f"{fw.name} {dtype} {op} {shape} {mode} integral={integral}",
                       run_case, fw, dtype, op, shape, mode, integral, checks, digests)
    everyone = comm.allgather(digests)
    checks.check(all(d == digests for d in everyone),
                 "results differ between ranks: " + str(next(
                     (a, b) for d in everyone for a, b in zip(d, digests, strict=False) if a != b)
                     if any(d != digests for d in everyone) else ""))


@pytest.mark.across_nodes
@pytest.mark.minimum_versions
@pytest.mark.mpi(ranks=(1, 2, 3, 4))
@pytest.mark.parametrize(CASE, cases())
def test_matrix(framework, dtype, op, mode, checks, comm):
    run_matrix(framework, dtype, op, mode, checks, comm)


@pytest.mark.one_mpi  # segments above the MPI calls; the matrix has every dtype on both MPIs
@pytest.mark.mpi(ranks=(2, 3))
@pytest.mark.parametrize(CASE, cases(big=True))
def test_over_one_mib(framework, dtype, op, mode, checks, comm):
    """Tensors over 1 MiB (sum, max, bxor, bor)."""
    run_matrix(framework, dtype, op, mode, checks, comm, shapes=BIG_SHAPES)


@pytest.mark.mpi(ranks=(2, 3))
@pytest.mark.parametrize("count_limit", [pytest.param(5, id="limit5")], indirect=True)
@pytest.mark.parametrize(CASE, cases())
def test_counts_above_the_int_limit(framework, dtype, op, mode, count_limit, checks, comm):
    """A lowered limit sends every tensor over 5 elements through MPI_Allreduce_c
    (MPI-4 large counts) or, where the MPI lacks it, through chunks."""
    run_matrix(framework, dtype, op, mode, checks, comm)


@pytest.mark.mpi(ranks=(1, 2, 3, 4))
@pytest.mark.parametrize("segment_bytes", [pytest.param(16, id="segment16")], indirect=True)
@pytest.mark.parametrize(CASE, cases())
def test_segmented(framework, dtype, op, mode, segment_bytes, checks, comm):
    """16-byte segments: every tensor of several elements goes in many MPI calls (counted),
    the results match the reference and are bit-identical on every rank."""
    run_matrix(framework, dtype, op, mode, checks, comm)


@pytest.mark.mpi(ranks=(2, 3))
@pytest.mark.parametrize("segment_bytes", [pytest.param(8, id="segment8"),
                                           pytest.param(64, id="segment64")], indirect=True)
@pytest.mark.parametrize("count_limit", [pytest.param(5, id="limit5")], indirect=True)
@pytest.mark.parametrize(CASE, cases(frameworks=("numpy",)))
def test_segmented_with_the_int_limit(framework, dtype, op, mode, count_limit, segment_bytes,
                                      checks, comm):
    """Segments below and above a lowered int-count limit: whichever is smaller cuts."""
    run_matrix(framework, dtype, op, mode, checks, comm)


@pytest.mark.one_mpi
@pytest.mark.mpi(ranks=(3,))
@pytest.mark.parametrize("segment_bytes", [pytest.param(1048576, id="segment1048576"),
                                           pytest.param(0, id="segment0")], indirect=True)
@pytest.mark.parametrize(CASE, cases(big=True))
def test_segments_over_one_mib(framework, dtype, op, mode, segment_bytes, checks, comm):
    """The default segment size on tensors of a few MiB, and segmentation off."""
    run_matrix(framework, dtype, op, mode, checks, comm, shapes=BIG_SHAPES)


def _available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


# the least any rank sees, so that every rank makes the same choice
AVAILABLE_GIB = MPI.COMM_WORLD.allreduce(_available_gib(), op=MPI.MIN)


@pytest.mark.mpi(ranks=(2,))
@pytest.mark.timeout(600)
@pytest.mark.skipif(AVAILABLE_GIB < 8, reason="needs about 2.2 GiB a rank (8 GiB free)")
def test_more_than_2_to_the_31_elements(checks, comm):
    """allreduce_ of 2**31 + 4097 int8 on 2 ranks: the count does not fit an int; correct,
    at both ends."""
    n = 2**31 + 4097
    x = np.full(n, comm.rank + 1, dtype=np.int8)
    x[-1] = 2 * (comm.rank + 1)  # the last element differs: an off-by-one loses it
    fastreduce.allreduce_(x)
    total = sum(r + 1 for r in range(comm.size))
    checks.check(int(x[:-1].min()) == total and int(x[:-1].max()) == total,
                 f"elements 0..n-2: min {x[:-1].min()} max {x[:-1].max()}, want {total}")
    checks.check(int(x[-1]) == 2 * total, f"last element {x[-1]}, want {2 * total}")
