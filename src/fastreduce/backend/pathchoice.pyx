"""The per-call choice between the direct and the staged GPU path.

A call may hand device pointers to MPI only where the MPI promises to accept them for
that kind of call (fastreduce.gpupaths.capabilities, or the user's override), and
only with MPI's own operations. Among the calls where both paths are allowed, the mode
(FASTREDUCE_GPU_PATH) decides, and in "auto" mode a size table.

The decision decides which MPI calls a rank makes, so every rank of a communicator must
reach the same one. The first eligible call on each communicator therefore agrees on the
settings with the other ranks (one allgather; a difference raises on every rank) and, in
auto mode with no pinned table, calibrates; the outcome is kept in an MPI attribute of the
communicator, so later calls cost one attribute look-up. Changing a setting (forget())
makes each communicator agree again at its next call. The agreement installed at set-up
(set_agreement) is fastreduce.gpupaths.agreement.agree: it gives (mode, device pointer
support, auto mode's size table) that every rank of the communicator agreed on.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc

from .algochoice cimport choose_algorithm, plan_for
from .commrecord cimport (
    MAX_TABLE_STEPS,
    RecordHead,
    StepTable,
    cached_record,
    fill_steps,
    keep_record,
    step_choice,
)
from .dtypes cimport KIND_BFLOAT16, KIND_FLOAT16
from .libmpi cimport *
from .reductions cimport Reduction

cdef extern from "algorithms.h" nogil:
    enum:
        FR_ALGO_MPI

cdef enum:
    MODE_AUTO = 0
    MODE_DIRECT = 1
    MODE_STAGED = 2

ctypedef struct Agreed:
    # What the ranks of one communicator agreed on, for one generation of the settings.
    int64_t generation   # first, as commrecord.pxd requires
    int mode
    bint blocking        # blocking MPI_Allreduce may take device pointers
    bint nonblocking     # ... MPI_Iallreduce too
    bint half            # ... with MPI's own 16-bit float datatypes too
    StepTable table      # auto mode's size table: PATH_* by size

_MODES = {"auto": MODE_AUTO, "direct": MODE_DIRECT, "staged": MODE_STAGED}
_PATHS = {"staged": PATH_STAGED, "direct": PATH_DIRECT}

# path_counts(): the path each GPU call took since the last reset
cdef uint64_t _direct_calls = 0    # device pointers went to MPI
cdef uint64_t _staged_calls = 0    # staged through pinned host memory

include "agreement.pxi"


cdef int _free_record(MPI_Comm comm, int keyval, void* value, void* extra) noexcept nogil:
    free(value)
    return MPI_SUCCESS


cdef void _forgotten() noexcept nogil:
    pass


cdef Agreed* _new_agreed(mode, support, steps) except NULL:
    """A C record from the agreement's answer."""
    cdef Agreed* agreed = <Agreed*>malloc(sizeof(Agreed))
    if agreed == NULL:
        raise MemoryError("fastreduce: out of memory for a GPU path table")
    try:
        fill_steps(&agreed.table, steps, _PATHS, MAX_TABLE_STEPS, "a GPU path table")
        agreed.mode = _MODES[mode]
    except BaseException:
        free(agreed)
        raise
    agreed.blocking = support.blocking
    agreed.nonblocking = support.nonblocking
    agreed.half = support.half
    return agreed


cdef const Agreed* _agreed(object comm, MPI_Comm handle) except NULL:
    """The communicator's agreed settings: its attribute, else agreed now (collective)."""
    cdef void* kept = _kept(handle)
    if kept != NULL:
        return <const Agreed*>kept
    # (mode, device pointer support, auto mode's size table); comm None: the default one
    mode, support, steps = _agree_now(comm, "GPU path settings")
    cdef Agreed* agreed = _new_agreed(mode, support, steps)
    _keep(handle, agreed)  # frees an older record
    return agreed


cdef int _decide(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                 const Reduction* red, int kind) except -1:
    if not red.predefined or red.divide_kind >= 0:  # computed on the host by fastreduce
        return PATH_STAGED
    if choose_algorithm(plan_for(handle), nbytes) != FR_ALGO_MPI:  # combines on the host
        return PATH_STAGED
    return _decide_agreed(comm, handle, nbytes, nonblocking, kind == KIND_FLOAT16
                          or kind == KIND_BFLOAT16)


cdef int _decide_agreed(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                        bint half) except -1:
    """The agreed mode, the MPI's promise (half: for its 16-bit float datatypes too) and
    auto mode's size table."""
    cdef const Agreed* agreed = _agreed(comm, handle)
    if agreed.mode == MODE_STAGED:
        return PATH_STAGED
    if not (agreed.nonblocking if nonblocking else agreed.blocking):
        return PATH_STAGED
    if half and not agreed.half:
        return PATH_STAGED
    if agreed.mode == MODE_DIRECT:
        return PATH_DIRECT
    return step_choice(&agreed.table, nbytes)


cdef int choose_path(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                     const Reduction* red, int kind) except -1:
    """PATH_DIRECT or PATH_STAGED for one call on CUDA device memory (counted)."""
    global _direct_calls, _staged_calls
    cdef int path = _decide(comm, handle, nbytes, nonblocking, red, kind)
    if path == PATH_DIRECT:
        _direct_calls += 1
    else:
        _staged_calls += 1
    return path


cdef int choose_movement_path(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                              int kind, const Reduction* red, bint collective) except -1:
    """PATH_DIRECT or PATH_STAGED for a data-movement call (broadcast, gathers, all-to-all,
    send/recv; red: the reduction of reduce and reduce-scatter, else NULL: bytes moved, so
    16-bit floats need no MPI datatype of theirs) on CUDA device memory (counted): as for
    all-reduce, less the all-reduce algorithm's part. A call the other ranks do not join
    (not `collective`: send, recv) cannot start the ranks' agreement: staged until it is
    made."""
    global _direct_calls, _staged_calls
    cdef int path
    if red != NULL and (not red.predefined or red.divide_kind >= 0):
        path = PATH_STAGED  # fastreduce's own op, or avg's division: on the host
    elif not collective and _kept(handle) == NULL:
        path = PATH_STAGED
    else:
        path = _decide_agreed(comm, handle, nbytes, nonblocking, red != NULL and (
            kind == KIND_FLOAT16 or kind == KIND_BFLOAT16))
    if path == PATH_DIRECT:
        _direct_calls += 1
    else:
        _staged_calls += 1
    return path


def path_counts() -> dict:
    """How many GPU calls took each path since reset_path_counts() (direct_calls: device
    pointers to MPI; staged_calls: through pinned host memory)."""
    return {"direct_calls": _direct_calls, "staged_calls": _staged_calls}


def reset_path_counts() -> None:
    """Zero path_counts()."""
    global _direct_calls, _staged_calls
    _direct_calls = _staged_calls = 0
