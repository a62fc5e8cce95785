"""The per-call choice between the direct and the staged GPU path.

A call may hand device pointers to MPI only where the MPI promises to accept them for
that kind of call (fastreduce.gpupath's capability table, or the user's override), and
only with MPI's own operations. Among the calls where both paths are allowed, the mode
(FASTREDUCE_GPU_PATH) decides, and in "auto" mode a size table: pinned by the user, or
measured once per communicator group by a collective calibration and kept in an MPI
attribute of the communicator, so every later call costs one attribute look-up.
"""

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

from ._cuda cimport count_path
from ._dtypes cimport KIND_BFLOAT16, KIND_FLOAT16
from ._errors cimport CHKERR
from ._libmpi cimport *
from ._ops cimport Reduction

cdef enum:
    MODE_AUTO = 0
    MODE_DIRECT = 1
    MODE_STAGED = 2
    MAX_STEPS = 64

ctypedef struct Thresholds:
    int nsteps
    int64_t start[MAX_STEPS]   # from this many bytes up ...
    int path[MAX_STEPS]        # ... this path, up to the next step's start

_MODES = {"auto": MODE_AUTO, "direct": MODE_DIRECT, "staged": MODE_STAGED}
_PATHS = {"staged": PATH_STAGED, "direct": PATH_DIRECT}

cdef bint _resolved = False
cdef int _mode = MODE_STAGED
cdef bint _blocking = False      # blocking MPI_Allreduce may take device pointers
cdef bint _nonblocking = False   # ... MPI_Iallreduce too
cdef bint _half = False          # ... with MPI's own 16-bit float datatypes too
cdef Thresholds* _pinned = NULL  # FASTREDUCE_GPU_THRESHOLDS: for every communicator
cdef int _keyval = MPI_KEYVAL_INVALID


cdef int _free_thresholds(MPI_Comm comm, int keyval, void* value,
                          void* extra) noexcept nogil:
    free(value)
    return MPI_SUCCESS


cdef Thresholds* _new_thresholds(steps) except NULL:
    """A C table from [(start_bytes, "direct" | "staged"), ...] (starts ascending, first 0)."""
    if not 1 <= len(steps) <= MAX_STEPS:
        raise ValueError(f"fastreduce: a GPU path table has 1 to {MAX_STEPS} steps, "
                         f"not {len(steps)}")
    cdef Thresholds* table = <Thresholds*>malloc(sizeof(Thresholds))
    if table == NULL:
        raise MemoryError("fastreduce: out of memory for a GPU path table")
    table.nsteps = len(steps)
    for i, (start, path) in enumerate(steps):
        table.start[i] = start
        table.path[i] = _PATHS[path]
    return table


cdef int _resolve() except -1:
    """Read the settings and the capability table from fastreduce.gpupath (once)."""
    global _resolved, _mode, _blocking, _nonblocking, _half, _pinned
    from . import gpupath

    mode, support, pinned = gpupath._core_settings()
    free(_pinned)
    _pinned = NULL
    if pinned is not None:
        _pinned = _new_thresholds(pinned)
    _mode = _MODES[mode]
    _blocking, _nonblocking, _half = support.blocking, support.nonblocking, support.half
    _resolved = True
    return 0


def forget() -> None:
    """Read the settings again at the next GPU call (after they changed)."""
    global _resolved
    _resolved = False


cdef const Thresholds* _comm_thresholds(object comm, MPI_Comm handle) except NULL:
    """The communicator's size table: its attribute, else calibrated now (collective)."""
    global _keyval
    cdef void* value = NULL
    cdef int found = 0
    if _keyval == MPI_KEYVAL_INVALID:
        CHKERR(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, _free_thresholds, &_keyval, NULL))
    CHKERR(MPI_Comm_get_attr(handle, _keyval, &value, &found))
    if found:
        return <const Thresholds*>value
    from . import gpupath

    if comm is None:
        from ._collectives import default_comm
        comm = default_comm()
    cdef Thresholds* table = _new_thresholds(gpupath._thresholds_for(comm))
    cdef int ierr = MPI_Comm_set_attr(handle, _keyval, table)
    if ierr != MPI_SUCCESS:
        free(table)
        CHKERR(ierr)
    return table


cdef inline int _lookup(const Thresholds* table, int64_t nbytes) noexcept nogil:
    cdef int i = table.nsteps - 1
    while i > 0 and nbytes < table.start[i]:
        i -= 1
    return table.path[i]


cdef int _decide(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                 const Reduction* red, int kind) except -1:
    if not _resolved:
        _resolve()
    if _mode == MODE_STAGED:
        return PATH_STAGED
    if not red.predefined or red.divide_kind >= 0:  # computed on the host by fastreduce
        return PATH_STAGED
    if not (_nonblocking if nonblocking else _blocking):
        return PATH_STAGED
    if (kind == KIND_FLOAT16 or kind == KIND_BFLOAT16) and not _half:
        return PATH_STAGED
    if _mode == MODE_DIRECT:
        return PATH_DIRECT
    if _pinned != NULL:
        return _lookup(_pinned, nbytes)
    return _lookup(_comm_thresholds(comm, handle), nbytes)


cdef int choose_path(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                     const Reduction* red, int kind) except -1:
    """PATH_DIRECT or PATH_STAGED for one call on CUDA device memory (counted)."""
    cdef int path = _decide(comm, handle, nbytes, nonblocking, red, kind)
    count_path(path == PATH_DIRECT)
    return path
