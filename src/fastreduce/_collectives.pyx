# cython: warn.unused=False
# (the `_owner` locals are unused on purpose: they keep DLPack export capsules,
# and so the memory MPI works on, alive until the call returns)
"""Blocking all-reduce of DLPack tensors, with the GIL released around each MPI call."""

from mpi4py cimport MPI

from libc.limits cimport INT_MAX
from libc.stdint cimport int64_t

from ._buffer cimport BufferView, acquire, check_same_layout, new_like
from ._errors cimport CHKERR
from ._libmpi cimport *
from ._ops cimport Reduction, get_reduction, op_code

from mpi4py import MPI as _MPI

cdef extern from "_halfops.h" nogil:
    void fr_divide(void* data, int64_t count, int kind, int divisor)

cdef MPI_Comm _default_handle = MPI_COMM_NULL
cdef object _default_comm = None
cdef int64_t _count_limit = INT_MAX


def default_comm():
    """The communicator used when comm=None: a duplicate of COMM_WORLD, made once (collective)."""
    global _default_comm, _default_handle
    if _default_comm is None:
        comm = _MPI.COMM_WORLD.Dup()
        comm.Set_errhandler(_MPI.ERRORS_RETURN)
        comm.Set_name("fastreduce default")
        _default_comm = comm
        _default_handle = <MPI_Comm>(<MPI.Comm>comm).ob_mpi
    return _default_comm


cdef int _resolve_comm(object comm, MPI_Comm* out) except -1:
    if comm is None:
        if _default_handle == MPI_COMM_NULL:
            default_comm()
        out[0] = _default_handle
        return 0
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"fastreduce: comm must be an mpi4py intracommunicator or None, not "
                        f"{type(comm).__qualname__}")
    cdef MPI_Comm handle = <MPI_Comm>(<MPI.Comm>comm).ob_mpi
    if handle == MPI_COMM_NULL:
        raise ValueError("fastreduce: comm is MPI.COMM_NULL (freed, or this rank is not in "
                         "it); pass a live intracommunicator, or None for the default")
    cdef int inter = 0
    if not isinstance(comm, MPI.Intracomm):
        CHKERR(MPI_Comm_test_inter(handle, &inter))
        if inter:
            raise ValueError("fastreduce: comm is an intercommunicator; all-reduce here needs "
                             "an intracommunicator (merge it with comm.Merge())")
    out[0] = handle
    return 0


cdef int _run(const void* sendbuf, char* recvbuf, int64_t count, const Reduction* red,
              MPI_Comm comm) except -1:
    """MPI_Allreduce of `count` elements, in chunks or large-count where needed, then avg."""
    cdef int ierr = MPI_SUCCESS
    cdef int size = 1
    cdef int64_t limit = _count_limit
    cdef int64_t offset = 0
    cdef int64_t n
    cdef int64_t stride = red.itemsize
    with nogil:
        if count <= limit:
            ierr = MPI_Allreduce(sendbuf, recvbuf, <int>count, red.datatype, red.op, comm)
        elif FASTREDUCE_HAVE_LARGE_COUNT and red.predefined:
            ierr = fr_allreduce_large(sendbuf, recvbuf, count, red.datatype, red.op, comm)
        else:
            while offset < count and ierr == MPI_SUCCESS:
                n = min(limit, count - offset)
                ierr = MPI_Allreduce(
                    sendbuf if sendbuf == MPI_IN_PLACE else <const char*>sendbuf + offset * stride,
                    recvbuf + offset * stride, <int>n, red.datatype, red.op, comm)
                offset += n
    CHKERR(ierr)
    if red.divide_kind >= 0:
        CHKERR(MPI_Comm_size(comm, &size))
        with nogil:
            fr_divide(recvbuf, count, red.divide_kind, size)
    return 0


def allreduce_(x, op="sum", *, comm=None):
    """Reduce x over all ranks of comm in place (MPI_IN_PLACE) and return x."""
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int code = op_code(op)
    _resolve_comm(comm, &handle)
    _owner = acquire(x, &view, True, "x")
    cdef const Reduction* red = get_reduction(view.kind, code)
    _run(MPI_IN_PLACE, view.data, view.count, red, handle)
    return x


def allreduce(x, op="sum", *, comm=None, out=None):
    """Return the reduction of x over all ranks of comm, in a new tensor or in `out`; x is kept."""
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int code = op_code(op)
    _resolve_comm(comm, &handle)
    _owner = acquire(x, &view, False, "x")
    cdef const Reduction* red = get_reduction(view.kind, code)
    if out is None:
        out = new_like(x, &view, &result)
        _out_owner = None
    else:
        _out_owner = acquire(out, &result, True, "out")
        check_same_layout(&view, &result)
    cdef const void* sendbuf = view.data
    cdef int64_t nbytes = view.count * red.itemsize
    if result.data == view.data:
        sendbuf = MPI_IN_PLACE  # out is x itself
    elif nbytes and result.data < view.data + nbytes and view.data < result.data + nbytes:
        raise ValueError("fastreduce: out overlaps x in memory; pass a separate out, or use "
                         "allreduce_ to reduce in place")
    _run(sendbuf, result.data, view.count, red, handle)
    return out


def _set_count_limit(int64_t limit) -> int:
    """Largest count passed to one int-count MPI call (INT_MAX); lowered by tests. Returns old."""
    global _count_limit
    if limit < 1 or limit > INT_MAX:
        raise ValueError(f"count limit must be in [1, {INT_MAX}]")
    old, _count_limit = _count_limit, limit
    return old


def _reduce_local(inbuf, inoutbuf, op="sum"):
    """MPI_Reduce_local(inbuf, inoutbuf) with fastreduce's datatype and op; for tests."""
    cdef BufferView a, b
    _owner_a = acquire(inbuf, &a, False, "inbuf")
    _owner_b = acquire(inoutbuf, &b, True, "inoutbuf")
    check_same_layout(&a, &b)
    cdef const Reduction* red = get_reduction(a.kind, op_code(op))
    CHKERR(MPI_Reduce_local(a.data, b.data, <int>a.count, red.datatype, red.op))
    return inoutbuf


HAVE_LARGE_COUNT = bool(FASTREDUCE_HAVE_LARGE_COUNT)
