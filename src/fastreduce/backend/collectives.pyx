# cython: warn.unused=False
# (the `_owner` locals are unused on purpose: they keep DLPack export capsules,
# and so the memory MPI works on, alive until the call returns)
"""All-reduce of DLPack tensors: blocking, non-blocking (Request) and coalesced.

The GIL is released around every MPI call that can wait for other ranks. One extension
module made of the coll_*.pxi files, one concern each, so that the hot path's calls
between them stay C calls. Nothing here imports the Python layers above: debug mode and
the flight record are hooks the Python core installs (coll_hooks.pxi).
"""

cimport cython
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from mpi4py cimport MPI

from libc.math cimport INFINITY
from libc.stdint cimport int32_t, int64_t, intptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy
from posix.time cimport clock_gettime, timespec

from .algochoice cimport plan_for
from .buffer cimport BufferView, Resolved, acquire, check_same_layout, device_name, new_like
from .cudart cimport (
    MEMCPY_D2H, MEMCPY_H2D, STAGING_SLOTS, Staging, check_not_capturing, chunk_bytes,
    copy_async, cudaStream_t, event_record, event_sync, movement_chunk_bytes, staging_give,
    staging_order, staging_release, staging_take, stream_sync, stream_wait_event,
)
from .dlpack cimport kDLCPU, kDLCUDA, kDLCUDAManaged
from .dtypes cimport KIND_INT64, KIND_UINT8, NKINDS
from .engine cimport Job, enabled, host_enabled, on_engine_thread, submit, wait_for
from .mpierrors cimport CHKERR
from .pathchoice cimport PATH_DIRECT, choose_movement_path, choose_path
from .libmpi cimport *
from .reductions cimport (
    OP_AVG, OP_SUM, Reduction, compression_code, get_compressed, get_reduction, op_code,
)
from .reduce cimport _run, _run_in, count_limit, segment_bytes_now
from .staging cimport (
    _check_capture, _copy_in_whole, _device_run, _drain, _pipeline_begin, _pipeline_end,
    _StagedJob, _wait_out_producer, _wait_producers,
)

import atexit
import sys
import weakref
from contextlib import nullcontext

from mpi4py import MPI as _MPI

from .commattr import create_keyval as _create_keyval
from .commattr import get_attr as _get_attr
from .commattr import set_attr as _set_attr
from .algochoice import set_plan_hook as _set_plan_hook
from .engine import state as _engine_state
from .reductions import KIND_NAMES as _KIND_NAMES

cdef extern from "algorithms.h" nogil:
    enum:
        FR_WIRE_NONE

cdef extern from "Python.h":
    int Py_IsInitialized() nogil

cdef extern from "halfops.h" nogil:
    void fr_divide(void* data, int64_t count, int kind, int divisor)


include "coll_arguments.pxi"
include "coll_hooks.pxi"
include "coll_blocking.pxi"
include "coll_requests.pxi"
include "coll_engine_jobs.pxi"
include "coll_coalesced.pxi"
include "coll_agreed.pxi"
include "coll_movement.pxi"
include "coll_lifetime.pxi"

_watch_finalize()
_set_plan_hook(_plan_made)


# --- for tests and the torch.distributed backend ------------------------------------

def _reduce_local(inbuf, inoutbuf, op="sum"):
    """MPI_Reduce_local(inbuf, inoutbuf) with fastreduce's datatype and op; for tests."""
    cdef BufferView a, b
    _owner_a = acquire(inbuf, &a, False, "inbuf")
    _owner_b = acquire(inoutbuf, &b, True, "inoutbuf")
    check_same_layout(&a, &b)
    if a.on_device:
        raise TypeError("_reduce_local takes host memory")
    cdef const Reduction* red = get_reduction(a.kind, op_code(op))
    CHKERR(MPI_Reduce_local(a.data, b.data, <int>a.count, red.datatype, red.op))
    return inoutbuf


def mpi_reduction(x, op="sum") -> tuple:
    """(MPI datatype, MPI op) that reduce x's elements with `op` as allreduce does (MPI's
    own, or fastreduce's for 16-bit floats); "avg" reduces with "sum" (divide afterwards).
    For the torch.distributed backend's MPI_Reduce and MPI_Reduce_scatter_block."""
    cdef BufferView view
    cdef int code = op_code(op)
    _owner = acquire(x, &view, False, "x")
    cdef const Reduction* red = get_reduction(view.kind, OP_SUM if code == OP_AVG else code)
    cdef MPI.Datatype datatype = MPI.Datatype.__new__(MPI.Datatype)
    cdef MPI.Op mpi_op = MPI.Op.__new__(MPI.Op)
    datatype.ob_mpi = red.datatype  # borrowed: not freed by mpi4py (flags say not owned)
    mpi_op.ob_mpi = red.op
    return datatype, mpi_op


HAVE_LARGE_COUNT = bool(fr_have_large_count())  # (looked up now, before any thread asks)
