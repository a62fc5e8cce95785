"""Bad input raises on the calling rank, before any MPI call, and changes nothing.

Every rank makes the same bad calls (so no collective is left half-entered),
checks the exception type and that its message names the fix, checks that no
tensor was modified, and finally runs a good all-reduce to show the
communicators are still in step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_dlpack import IS_COPIED, READ_ONLY, FakeTensor, LegacyOnly, RequiresGrad
from mpi4py import MPI

import fastreduce

pytestmark = pytest.mark.mpi(ranks=(1, 2, 3))


def rand(*shape, dtype=torch.float32):
    return torch.rand(*shape).to(dtype)


def test_layout(checks, comm):
    """Non-contiguous tensors are refused, naming the fix; size-1 dimensions may carry any
    stride."""
    t = rand(4, 6)
    checks.expect(BufferError, ["not contiguous", ".contiguous()"],
                  lambda: fastreduce.allreduce_(t[:, ::2]), t)
    checks.expect(BufferError, ["not contiguous"], lambda: fastreduce.allreduce(t.T), t)
    a = np.random.default_rng(comm.rank).random((5, 4))
    checks.expect(BufferError, ["not contiguous", "ascontiguousarray"],
                  lambda: fastreduce.allreduce_(a.T), a)
    # size-1 dimensions may carry any stride: these are contiguous
    fastreduce.allreduce_(torch.zeros(3, 1).T)
    fastreduce.allreduce_(torch.zeros(4, 3)[1:2])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_dtypes_that_do_not_reduce(checks):
    f8 = torch.zeros(3, dtype=torch.float8_e4m3fn)
    checks.expect(TypeError, ["float8_e4m3fn", "does not reduce"],
                  lambda: fastreduce.allreduce_(f8))
    c32 = torch.zeros(3, dtype=torch.complex32)
    checks.expect(TypeError, ["complex32", "does not reduce"], lambda: fastreduce.allreduce(c32))


def test_ops(checks):
    """An op the dtype has not, an unknown op, an op of the wrong type, a user MPI.Op."""
    i = torch.arange(5, dtype=torch.int32)
    checks.expect(ValueError, ["'avg'", "int32", "op='sum'"],
                  lambda: fastreduce.allreduce_(i, "avg"), i)
    x = rand(5)
    checks.expect(ValueError, ["'band'", "float32", "integer"],
                  lambda: fastreduce.allreduce_(x, "band"), x)
    b = torch.ones(5, dtype=torch.bool)
    checks.expect(ValueError, ["'sum'", "bool", "bor"], lambda: fastreduce.allreduce_(b, "sum"), b)
    z = torch.ones(5, dtype=torch.complex64)
    checks.expect(ValueError, ["'max'", "complex64", "sum, prod"],
                  lambda: fastreduce.allreduce(z, "max"), z)
    checks.expect(ValueError, ["unknown reduction op 'mean'", "avg"],
                  lambda: fastreduce.allreduce_(x, "mean"), x)
    checks.expect(TypeError, ["op must be"], lambda: fastreduce.allreduce_(x, 3), x)
    checks.expect(ValueError, ["predefined MPI.SUM"],
                  lambda: fastreduce.allreduce_(x, MPI.MAXLOC), x)


def test_out(checks, comm):
    """out= of the wrong shape, dtype or layout, read-only, or overlapping x; out=x is an
    explicit request to reduce in place."""
    x = rand(6)
    checks.expect(ValueError, ["out has shape [5]", "[6]"],
                  lambda: fastreduce.allreduce(x, out=rand(5)), x)
    o = rand(2, 3)
    checks.expect(ValueError, ["out has shape [2, 3]"], lambda: fastreduce.allreduce(x, out=o),
                  x, o)
    o = torch.zeros(6, dtype=torch.float64)
    checks.expect(ValueError, ["out has dtype float64", "float32"],
                  lambda: fastreduce.allreduce(x, out=o), x, o)
    o = torch.zeros(6, 2)
    checks.expect(BufferError, ["out is not contiguous"],
                  lambda: fastreduce.allreduce(x, out=o[:, 0]), x, o)
    ro = np.zeros(6, np.float32)
    ro.flags.writeable = False
    xa = np.arange(6, dtype=np.float32)
    checks.expect(BufferError, ["out is read-only"], lambda: fastreduce.allreduce(xa, out=ro),
                  xa, ro)
    checks.expect(BufferError, ["x is read-only"], lambda: fastreduce.allreduce_(ro), ro)
    # a read-only array is a fine input
    res = fastreduce.allreduce(ro)
    checks.check(np.array_equal(res, np.zeros(6)) and res.flags.writeable, "read-only input")
    buf = np.arange(10, dtype=np.float64)
    checks.expect(ValueError, ["overlaps"], lambda: fastreduce.allreduce(buf[0:6], out=buf[2:8]),
                  buf)
    # out may be x itself: that is an explicit request to reduce in place
    y = torch.full((3,), float(comm.rank))
    fastreduce.allreduce(y, out=y)
    checks.check(torch.equal(y, torch.full((3,), float(sum(range(comm.size))))), "out=x")


def test_not_dlpack(checks):
    checks.expect(TypeError, ["builtins.list", "does not support DLPack"],
                  lambda: fastreduce.allreduce_([1.0]))
    checks.expect(TypeError, ["float", "does not support DLPack"],
                  lambda: fastreduce.allreduce(2.0))


def test_coalesced_needs_a_list(checks):
    """allreduce_coalesced_ given one tensor (not a list of them) refuses, saying to pass a
    list; before, it reduced the tensor's rows one by one as separate tensors."""
    for x in (torch.ones(3, 2), np.ones((3, 2))):
        checks.expect(TypeError, ["takes a list of tensors", "pass [tensor]", "allreduce_"],
                      lambda x=x: fastreduce.allreduce_coalesced_(x), x)


def test_cuda_memory_without_a_runtime(checks, monkeypatch):
    """CUDA memory with no CUDA runtime to be had (the CUDA staging tests cover the
    rest)."""
    if fastreduce.backend.cudart.runtime_info()["path"] is not None:
        pytest.skip("an earlier case of this session loaded a CUDA runtime")
    monkeypatch.setenv("FASTREDUCE_CUDART", "/nonexistent/libcudart.so.12")
    arr = np.ones(4, np.float32)
    checks.expect(RuntimeError, ["x is on cuda:0", "no CUDA runtime library", "FASTREDUCE_CUDART"],
                  lambda: fastreduce.allreduce_(FakeTensor(arr, device=(2, 0))), arr)
    checks.expect(RuntimeError, ["out is on cuda:1", "no CUDA runtime library"],
                  lambda: fastreduce.allreduce(
                      arr, out=FakeTensor(np.ones(4, np.float32), device=(2, 1))), arr)


def test_dlpack_exports_that_cannot_be_reduced(checks):
    """DLPack exports the tensors here cannot make: other devices, read-only or copied
    flags, unknown versions and dtypes, strides."""
    arr = np.ones(4, np.float32)
    checks.expect(TypeError, ["rocm:1", ".cpu()"],
                  lambda: fastreduce.allreduce_(FakeTensor(arr, device=(10, 1))), arr)
    checks.expect(BufferError, ["x is read-only"],
                  lambda: fastreduce.allreduce_(FakeTensor(arr, flags=READ_ONLY)), arr)
    checks.expect(BufferError, ["exported as a copy"],
                  lambda: fastreduce.allreduce_(FakeTensor(arr, flags=IS_COPIED)), arr)
    checks.expect(BufferError, ["DLPack 2.0", "1.x"],
                  lambda: fastreduce.allreduce_(FakeTensor(arr, version=(2, 0))), arr)
    checks.expect(TypeError, ["float8", "does not reduce"],
                  lambda: fastreduce.allreduce_(FakeTensor(arr, dtype=(2, 8, 1))), arr)
    checks.expect(TypeError, ["float32x4", "does not reduce"],
                  lambda: fastreduce.allreduce_(FakeTensor(arr, dtype=(2, 32, 4))), arr)
    checks.expect(TypeError, ["cannot allocate a result of type FakeTensor", "out="],
                  lambda: fastreduce.allreduce(FakeTensor(arr)), arr)
    arr2 = np.ones((3, 4), np.float32)
    checks.expect(BufferError, ["not contiguous"],
                  lambda: fastreduce.allreduce_(FakeTensor(arr2, strides=[1, 3])), arr2)


def test_dlpack_exports_that_work(checks, comm):
    """What such producers can legitimately export works: legacy capsules, NULL strides,
    byte_offset, read-only inputs, a tensor requiring grad (read through its detached view)."""
    p = comm.size
    for fake in (LegacyOnly(np.ones(5)), RequiresGrad(np.ones(5)), FakeTensor(np.ones(5), legacy=True),
                 FakeTensor(np.ones(5), strides=None), FakeTensor(np.ones(5), byte_offset=24)):
        fastreduce.allreduce_(fake)
        checks.check(np.array_equal(fake.array, np.full(5, float(p))),
                     f"{type(fake).__name__} sum")
    src = FakeTensor(np.full(3, 2.0), flags=READ_ONLY)
    dst = np.zeros(3)
    fastreduce.allreduce(src, out=dst)
    checks.check(np.array_equal(dst, np.full(3, 2.0 * p)), "read-only producer as input")


def test_communicators(checks, comm):
    """Not a communicator, COMM_NULL, a freed one."""
    x = rand(3)
    checks.expect(TypeError, ["comm must be an mpi4py intracommunicator"],
                  lambda: fastreduce.allreduce_(x, comm="world"), x)
    checks.expect(ValueError, ["COMM_NULL"], lambda: fastreduce.allreduce_(x, comm=MPI.COMM_NULL),
                  x)
    freed = comm.Dup()
    freed.Free()
    checks.expect(ValueError, ["COMM_NULL", "freed"], lambda: fastreduce.allreduce(x, comm=freed),
                  x)


@pytest.mark.mpi(ranks=(2, 3))
def test_intercommunicator(checks, comm):
    """An intercommunicator, also seen through a plain MPI.Comm (caught by
    MPI_Comm_test_inter)."""
    x = rand(3)
    half = comm.Split(comm.rank % 2, comm.rank)
    inter = half.Create_intercomm(0, comm, 1 - comm.rank % 2, tag=7)
    checks.expect(ValueError, ["intercommunicator", "Merge"],
                  lambda: fastreduce.allreduce_(x, comm=inter), x)
    # the same handle seen through a plain MPI.Comm is caught by MPI_Comm_test_inter
    plain = MPI.Comm.f2py(inter.py2f())
    checks.expect(ValueError, ["intercommunicator"], lambda: fastreduce.allreduce_(x, comm=plain),
                  x)
    inter.Free()
    half.Free()


def test_still_in_step(checks, comm):
    """Everyone is still in step: a good all-reduce after the rejected calls."""
    final = fastreduce.allreduce(torch.tensor([float(comm.rank)]))
    checks.check(final.item() == sum(range(comm.size)), "final allreduce after rejected calls")
