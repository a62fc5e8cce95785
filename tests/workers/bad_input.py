"""Bad input raises on the calling rank, before any MPI call, and changes nothing.

Every rank makes the same bad calls (so no collective is left half-entered),
checks the exception type and that its message names the fix, checks that no
tensor was modified, and finally runs a good all-reduce to show the
communicators are still in step.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from common import WORLD, Failures
from fake_dlpack import IS_COPIED, READ_ONLY, FakeTensor, LegacyOnly
from mpi4py import MPI

import fastreduce

fails = Failures()


expect = fails.expect


def rand(*shape, dtype=torch.float32):
    return torch.rand(*shape).to(dtype)


# --- layout -----------------------------------------------------------------
t = rand(4, 6)
expect(BufferError, ["not contiguous", ".contiguous()"], lambda: fastreduce.allreduce_(t[:, ::2]), t)
expect(BufferError, ["not contiguous"], lambda: fastreduce.allreduce(t.T), t)
a = np.random.default_rng(WORLD.rank).random((5, 4))
expect(BufferError, ["not contiguous", "ascontiguousarray"], lambda: fastreduce.allreduce_(a.T), a)
# size-1 dimensions may carry any stride: these are contiguous
fastreduce.allreduce_(torch.zeros(3, 1).T)
fastreduce.allreduce_(torch.zeros(4, 3)[1:2])

# --- dtypes and ops ---------------------------------------------------------
f8 = torch.zeros(3, dtype=torch.float8_e4m3fn)
expect(TypeError, ["float8_e4m3fn", "does not reduce"], lambda: fastreduce.allreduce_(f8))
c32 = torch.zeros(3, dtype=torch.complex32)
expect(TypeError, ["complex32", "does not reduce"], lambda: fastreduce.allreduce(c32))
i = torch.arange(5, dtype=torch.int32)
expect(ValueError, ["'avg'", "int32", "op='sum'"], lambda: fastreduce.allreduce_(i, "avg"), i)
x = rand(5)
expect(ValueError, ["'band'", "float32", "integer"], lambda: fastreduce.allreduce_(x, "band"), x)
b = torch.ones(5, dtype=torch.bool)
expect(ValueError, ["'sum'", "bool", "bor"], lambda: fastreduce.allreduce_(b, "sum"), b)
z = torch.ones(5, dtype=torch.complex64)
expect(ValueError, ["'max'", "complex64", "sum, prod"], lambda: fastreduce.allreduce(z, "max"), z)
expect(ValueError, ["unknown reduction op 'mean'", "avg"], lambda: fastreduce.allreduce_(x, "mean"), x)
expect(TypeError, ["op must be"], lambda: fastreduce.allreduce_(x, 3), x)
expect(ValueError, ["predefined MPI.SUM"], lambda: fastreduce.allreduce_(x, MPI.MAXLOC), x)

# --- out ----------------------------------------------------------------------
x = rand(6)
expect(ValueError, ["out has shape [5]", "[6]"], lambda: fastreduce.allreduce(x, out=rand(5)), x)
o = rand(2, 3)
expect(ValueError, ["out has shape [2, 3]"], lambda: fastreduce.allreduce(x, out=o), x, o)
o = torch.zeros(6, dtype=torch.float64)
expect(ValueError, ["out has dtype float64", "float32"], lambda: fastreduce.allreduce(x, out=o), x, o)
o = torch.zeros(6, 2)
expect(BufferError, ["out is not contiguous"], lambda: fastreduce.allreduce(x, out=o[:, 0]), x, o)
ro = np.zeros(6, np.float32)
ro.flags.writeable = False
xa = np.arange(6, dtype=np.float32)
expect(BufferError, ["out is read-only"], lambda: fastreduce.allreduce(xa, out=ro), xa, ro)
expect(BufferError, ["x is read-only"], lambda: fastreduce.allreduce_(ro), ro)
# a read-only array is a fine input
res = fastreduce.allreduce(ro)
fails.check(np.array_equal(res, np.zeros(6)) and res.flags.writeable, "read-only input")
buf = np.arange(10, dtype=np.float64)
expect(ValueError, ["overlaps"], lambda: fastreduce.allreduce(buf[0:6], out=buf[2:8]), buf)
# out may be x itself: that is an explicit request to reduce in place
y = torch.full((3,), float(WORLD.rank))
fastreduce.allreduce(y, out=y)
fails.check(torch.equal(y, torch.full((3,), float(sum(range(WORLD.size))))), "out=x")

# --- not DLPack at all ----------------------------------------------------------
expect(TypeError, ["builtins.list", "does not support DLPack"], lambda: fastreduce.allreduce_([1.0]))
expect(TypeError, ["float", "does not support DLPack"], lambda: fastreduce.allreduce(2.0))

# --- DLPack exports the tensors here cannot make ------------------------------------
arr = np.ones(4, np.float32)
# CUDA memory with no CUDA runtime to be had (tests/test_cuda_staging.py covers the rest)
os.environ["FASTREDUCE_CUDART"] = "/nonexistent/libcudart.so.12"
expect(RuntimeError, ["x is on cuda:0", "no CUDA runtime library", "FASTREDUCE_CUDART"],
       lambda: fastreduce.allreduce_(FakeTensor(arr, device=(2, 0))), arr)
expect(RuntimeError, ["out is on cuda:1", "no CUDA runtime library"],
       lambda: fastreduce.allreduce(arr, out=FakeTensor(np.ones(4, np.float32), device=(2, 1))),
       arr)
expect(TypeError, ["rocm:1", ".cpu()"], lambda: fastreduce.allreduce_(FakeTensor(arr, device=(10, 1))), arr)
expect(BufferError, ["x is read-only"],
       lambda: fastreduce.allreduce_(FakeTensor(arr, flags=READ_ONLY)), arr)
expect(BufferError, ["exported as a copy"],
       lambda: fastreduce.allreduce_(FakeTensor(arr, flags=IS_COPIED)), arr)
expect(BufferError, ["DLPack 2.0", "1.x"],
       lambda: fastreduce.allreduce_(FakeTensor(arr, version=(2, 0))), arr)
expect(TypeError, ["float8", "does not reduce"],
       lambda: fastreduce.allreduce_(FakeTensor(arr, dtype=(2, 8, 1))), arr)
expect(TypeError, ["float32x4", "does not reduce"],
       lambda: fastreduce.allreduce_(FakeTensor(arr, dtype=(2, 32, 4))), arr)
expect(TypeError, ["cannot allocate a result of type FakeTensor", "out="],
       lambda: fastreduce.allreduce(FakeTensor(arr)), arr)
arr2 = np.ones((3, 4), np.float32)
expect(BufferError, ["not contiguous"],
       lambda: fastreduce.allreduce_(FakeTensor(arr2, strides=[1, 3])), arr2)

# what such producers can legitimately export works: legacy capsules, NULL strides,
# byte_offset, read-only inputs
p = WORLD.size
for fake in (LegacyOnly(np.ones(5)), FakeTensor(np.ones(5), legacy=True),
             FakeTensor(np.ones(5), strides=None), FakeTensor(np.ones(5), byte_offset=24)):
    fastreduce.allreduce_(fake)
    fails.check(np.array_equal(fake.array, np.full(5, float(p))), f"{type(fake).__name__} sum")
src = FakeTensor(np.full(3, 2.0), flags=READ_ONLY)
dst = np.zeros(3)
fastreduce.allreduce(src, out=dst)
fails.check(np.array_equal(dst, np.full(3, 2.0 * p)), "read-only producer as input")

# --- communicators --------------------------------------------------------------
x = rand(3)
expect(TypeError, ["comm must be an mpi4py intracommunicator"],
       lambda: fastreduce.allreduce_(x, comm="world"), x)
expect(ValueError, ["COMM_NULL"], lambda: fastreduce.allreduce_(x, comm=MPI.COMM_NULL), x)
freed = WORLD.Dup()
freed.Free()
expect(ValueError, ["COMM_NULL", "freed"], lambda: fastreduce.allreduce(x, comm=freed), x)
if WORLD.size >= 2:
    half = WORLD.Split(WORLD.rank % 2, WORLD.rank)
    inter = half.Create_intercomm(0, WORLD, 1 - WORLD.rank % 2, tag=7)
    expect(ValueError, ["intercommunicator", "Merge"], lambda: fastreduce.allreduce_(x, comm=inter), x)
    # the same handle seen through a plain MPI.Comm is caught by MPI_Comm_test_inter
    plain = MPI.Comm.f2py(inter.py2f())
    expect(ValueError, ["intercommunicator"], lambda: fastreduce.allreduce_(x, comm=plain), x)
    inter.Free()
    half.Free()

# --- everyone is still in step ------------------------------------------------------
final = fastreduce.allreduce(torch.tensor([float(WORLD.rank)]))
fails.check(final.item() == sum(range(WORLD.size)), "final allreduce after rejected calls")
fails.finish()
