"""All-reduce of host memory with MPI, by the algorithm the communicator's plan chooses
for the size: the MPI's own MPI_Allreduce (one call, or one segment per call for large
messages, or int-sized chunks, or one large-count call past INT_MAX), or a composition of
MPI calls (ring, reduce-scatter + all-gather, hierarchical; algorithms.h); then avg's
division.

Every blocking reduction fastreduce makes goes through _run: the host path, each staged GPU
chunk, each dtype of a coalesced call, and the progress engine's jobs.
"""

from libc.limits cimport INT_MAX
from libc.stdint cimport int64_t
from libc.string cimport memcpy

from .algochoice cimport Plan, choose_algorithm, plan_for
from .mpierrors cimport CHKERR
from .libmpi cimport *
from .reductions cimport Reduction

from .algochoice import forget as _forget_plans

cdef extern from "algorithms.h" nogil:
    enum:
        FR_ALGO_MPI
        FR_WIRE_NONE
    ctypedef struct fr_combine:
        MPI_Datatype datatype
        MPI_Op op
        int itemsize
        int wire
        int opcode
        MPI_Datatype wire_datatype
        MPI_Op wire_op
    int fr_allreduce_by(int algorithm, char* buf, int64_t count, const fr_combine* c,
                        MPI_Comm comm, MPI_Comm local, MPI_Comm leaders, MPI_Comm cross,
                        int64_t piece_bytes)

cdef extern from "halfops.h" nogil:
    void fr_divide(void* data, int64_t count, int kind, int divisor)

cdef int64_t _count_limit = INT_MAX
fr_have_large_count()  # looked up now, before any thread may ask (mpicompat.h)
# DEFAULT_SEGMENT_BYTES until set-up hands down FASTREDUCE_SEGMENT_BYTES (0: one call);
# unless pinned (the setting, set_segment_bytes), each communicator's plan decides
cdef int64_t _segment_bytes = 4 << 20
cdef bint _segment_pinned = False


cdef inline int64_t _step(int64_t count, int itemsize, int64_t segment_bytes) noexcept nogil:
    """Elements per MPI call: a segment (when segmentation applies) or the int count limit."""
    cdef int64_t segment = max(segment_bytes // itemsize, 1) if segment_bytes else 0
    if segment > 0 and count > segment and segment < _count_limit:
        return segment
    return _count_limit

cdef extern from *:
    """
    /* MPI_Allreduce calls made by _run in this thread (the GPU path calibration counts its
     * own; per thread, so that other threads' calls do not disturb the count) */
    static __thread long long fr_thread_mpi_calls = 0;
    """
    long long fr_thread_mpi_calls


cdef int _run(const void* sendbuf, char* recvbuf, int64_t count, const Reduction* red,
              MPI_Comm comm) except -1:
    """_run_in with the segment size in force now."""
    return _run_in(sendbuf, recvbuf, count, red, comm, segment_bytes_now())


cdef int _run_in(const void* sendbuf, char* recvbuf, int64_t count, const Reduction* red,
                 MPI_Comm comm, int64_t segment_bytes) except -1:
    """The all-reduce of `count` elements by the communicator's algorithm for the size, then
    avg. segment_bytes < 0: the plan's segment size for the MPI's own call."""
    cdef const Plan* plan = plan_for(comm)
    cdef int algorithm = choose_algorithm(plan, count * red.itemsize)
    if segment_bytes < 0:
        segment_bytes = plan.segment_bytes
    if algorithm == FR_ALGO_MPI and red.wire == FR_WIRE_NONE:
        return _run_mpi(sendbuf, recvbuf, count, red, comm, segment_bytes)
    return _run_composed(algorithm, plan, sendbuf, recvbuf, count, red, comm)


cdef int _run_composed(int algorithm, const Plan* plan, const void* sendbuf, char* recvbuf,
                       int64_t count, const Reduction* red, MPI_Comm comm) except -1:
    """An algorithm of algorithms.h (or the MPI's call over a 16-bit wire), in place."""
    global fr_thread_mpi_calls
    cdef fr_combine c
    c.datatype, c.op, c.itemsize = red.datatype, red.op, red.itemsize
    c.wire, c.opcode = red.wire, red.opcode
    c.wire_datatype, c.wire_op = red.wire_datatype, red.wire_op
    cdef int ierr
    with nogil:
        if sendbuf != MPI_IN_PLACE:
            memcpy(recvbuf, sendbuf, count * red.itemsize)
        fr_thread_mpi_calls += 1
        # the ring's point-to-point messages on the plan's duplicate, never the user's comm
        ierr = fr_allreduce_by(algorithm, recvbuf, count, &c,
                               plan.ring if plan.ring != MPI_COMM_NULL else comm, plan.local,
                               plan.leaders, plan.cross, plan.piece_bytes)
    CHKERR(ierr)
    return _divide(recvbuf, count, red, comm)


cdef int _divide(char* recvbuf, int64_t count, const Reduction* red, MPI_Comm comm) except -1:
    """avg: the sum divided by the communicator's size."""
    cdef int size = 1
    if red.divide_kind >= 0:
        CHKERR(MPI_Comm_size(comm, &size))
        with nogil:
            fr_divide(recvbuf, count, red.divide_kind, size)
    return 0


cdef int _run_mpi(const void* sendbuf, char* recvbuf, int64_t count, const Reduction* red,
                  MPI_Comm comm, int64_t segment_bytes) except -1:
    """MPI_Allreduce of `count` elements, then avg: one call, or one per segment (large
    messages; faster than one call), or per int-sized chunk / large-count past INT_MAX."""
    global fr_thread_mpi_calls
    cdef int ierr = MPI_SUCCESS
    cdef int64_t limit = _step(count, red.itemsize, segment_bytes)
    cdef int64_t offset = 0
    cdef int64_t n
    cdef int64_t stride = red.itemsize
    with nogil:
        if count <= limit:
            fr_thread_mpi_calls += 1
            ierr = MPI_Allreduce(sendbuf, recvbuf, <int>count, red.datatype, red.op, comm)
        elif red.predefined and fr_have_large_count() and limit == _count_limit:
            fr_thread_mpi_calls += 1
            ierr = fr_allreduce_large(sendbuf, recvbuf, count, red.datatype, red.op, comm)
        else:
            while offset < count and ierr == MPI_SUCCESS:
                n = min(limit, count - offset)
                fr_thread_mpi_calls += 1
                ierr = MPI_Allreduce(
                    sendbuf if sendbuf == MPI_IN_PLACE else <const char*>sendbuf + offset * stride,
                    recvbuf + offset * stride, <int>n, red.datatype, red.op, comm)
                offset += n
    CHKERR(ierr)
    return _divide(recvbuf, count, red, comm)


def _set_count_limit(int64_t limit) -> int:
    """Largest count passed to one int-count MPI call (INT_MAX); lowered by tests. Returns old."""
    global _count_limit
    if limit < 1 or limit > INT_MAX:
        raise ValueError(f"count limit must be in [1, {INT_MAX}]")
    old, _count_limit = _count_limit, limit
    return old


# --- segmentation -------------------------------------------------------------------
#
# One MPI_Allreduce of a large host buffer is slower than the same bytes in a sequence of
# smaller calls, in both MPI families (see the README's measurements); so blocking calls
# above the segment size reduce one segment after another. The size decides how the ranks'
# MPI calls match: it must be the same on every rank.

DEFAULT_SEGMENT_BYTES = 4 << 20


def segment_bytes() -> int:
    """Bytes per MPI call of a segmented (large) blocking all-reduce; 0: one call."""
    return _segment_bytes


def set_segment_bytes(nbytes) -> object:
    """Pin segment_bytes() on this rank (0: off) for every communicator, instead of each
    one's plan, or None: unpin; the same on every rank. Returns the old (None: unpinned)."""
    global _segment_bytes, _segment_pinned
    old = _segment_bytes if _segment_pinned else None
    if nbytes is None:
        _segment_bytes, _segment_pinned = DEFAULT_SEGMENT_BYTES, False
    elif not 0 <= nbytes < 1 << 62:
        raise ValueError(f"fastreduce: segment size {nbytes}: give 0 (one MPI call per "
                         f"all-reduce), a positive number of bytes, or None (each "
                         f"communicator's plan)")
    else:
        _segment_bytes, _segment_pinned = nbytes, True
    _forget_plans()  # the ranks agree on it again (segments are MPI calls)
    return old


def segment_bytes_pinned() -> bool:
    """Whether segment_bytes() holds for every communicator (else each plan decides)."""
    return _segment_pinned


def _mpi_call_count() -> int:
    """MPI_Allreduce calls made by fastreduce's blocking paths in this thread so far."""
    return fr_thread_mpi_calls


def _call_plan(int64_t count, int itemsize) -> list:
    """The element counts of the MPI calls _run makes for `count` elements of `itemsize`
    bytes with MPI's own ops (the settings in force now): for a caller that must make the
    same calls as the other ranks after a local failure."""
    cdef int64_t step = _step(count, itemsize, _segment_bytes)
    if count <= step or (step == _count_limit and fr_have_large_count()):
        return [count]
    return [min(step, count - offset) for offset in range(0, count, step)]


cdef int64_t segment_bytes_now() noexcept nogil:
    """The pinned segment size, or -1: each communicator's plan decides."""
    return _segment_bytes if _segment_pinned else -1


cdef int64_t count_limit() noexcept nogil:
    """Largest count one int-count MPI call takes here (INT_MAX, lowered by tests)."""
    return _count_limit
