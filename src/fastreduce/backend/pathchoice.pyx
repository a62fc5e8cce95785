"""The per-call choice between the direct and the staged GPU path.

A call may hand device pointers to MPI only where the MPI promises to accept them for
that kind of call (fastreduce.gpupath's capability table, or the user's override), and
only with MPI's own operations. Among the calls where both paths are allowed, the mode
(FASTREDUCE_GPU_PATH) decides, and in "auto" mode a size table.

The decision decides which MPI calls a rank makes, so every rank of a communicator must
reach the same one. The first eligible call on each communicator therefore agrees on the
settings with the other ranks (one allgather; a difference raises on every rank) and, in
auto mode with no pinned table, calibrates; the outcome is kept in an MPI attribute of the
communicator, so later calls cost one attribute look-up. Changing a setting (forget())
makes each communicator agree again at its next call.
"""

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

from .algochoice cimport choose_algorithm, plan_for
from .cudart cimport count_path
from .dtypes cimport KIND_BFLOAT16, KIND_FLOAT16
from .commrecord cimport cached_record, keep_record
from .libmpi cimport *
from .reductions cimport Reduction

cdef extern from "algorithms.h" nogil:
    enum:
        FR_ALGO_MPI

cdef enum:
    MODE_AUTO = 0
    MODE_DIRECT = 1
    MODE_STAGED = 2
    MAX_STEPS = 64

ctypedef struct Agreed:
    # What the ranks of one communicator agreed on, for one generation of the settings.
    int64_t generation   # first, as commrecord.pxd requires
    int mode
    bint blocking        # blocking MPI_Allreduce may take device pointers
    bint nonblocking     # ... MPI_Iallreduce too
    bint half            # ... with MPI's own 16-bit float datatypes too
    int nsteps           # auto mode's size table:
    int64_t start[MAX_STEPS]   # from this many bytes up ...
    int path[MAX_STEPS]        # ... this path, up to the next step's start

_MODES = {"auto": MODE_AUTO, "direct": MODE_DIRECT, "staged": MODE_STAGED}
_PATHS = {"staged": PATH_STAGED, "direct": PATH_DIRECT}

cdef int64_t _generation = 1     # bumped by forget(): every communicator agrees again
cdef int _keyval = MPI_KEYVAL_INVALID


cdef int _free_agreed(MPI_Comm comm, int keyval, void* value, void* extra) noexcept nogil:
    free(value)
    return MPI_SUCCESS


cdef Agreed* _new_agreed(mode, support, steps) except NULL:
    """A C record from gpupath._agree's answer."""
    if not 1 <= len(steps) <= MAX_STEPS:
        raise ValueError(f"fastreduce: a GPU path table has 1 to {MAX_STEPS} steps, "
                         f"not {len(steps)}")
    cdef Agreed* agreed = <Agreed*>malloc(sizeof(Agreed))
    if agreed == NULL:
        raise MemoryError("fastreduce: out of memory for a GPU path table")
    agreed.generation = _generation
    agreed.mode = _MODES[mode]
    agreed.blocking = support.blocking
    agreed.nonblocking = support.nonblocking
    agreed.half = support.half
    agreed.nsteps = len(steps)
    for i, (start, path) in enumerate(steps):
        agreed.start[i] = start
        agreed.path[i] = _PATHS[path]
    return agreed


_agreement = None  # set-up's callable: comm -> (mode, support, steps) every rank agrees on


def set_agreement(agreement) -> None:
    """Install `agreement(comm)`, the collective that gives (mode, device pointer support,
    auto mode's size table) agreed by every rank of comm; asked at a communicator's first
    GPU call and again after forget()."""
    global _agreement
    _agreement = agreement
    forget()


def forget() -> None:
    """Settings changed: each communicator agrees on them again at its next GPU call."""
    global _generation
    _generation += 1


cdef const Agreed* _agreed(object comm, MPI_Comm handle) except NULL:
    """The communicator's agreed settings: its attribute, else agreed now (collective)."""
    cdef void* kept = cached_record(handle, &_keyval, _free_agreed, _generation)
    if kept != NULL:
        return <const Agreed*>kept
    if _agreement is None:
        raise RuntimeError("fastreduce: no GPU path settings agreement installed "
                           "(pathchoice.set_agreement)")
    mode, support, steps = _agreement(comm)  # comm None: the default communicator
    cdef Agreed* agreed = _new_agreed(mode, support, steps)
    keep_record(handle, _keyval, _free_agreed, agreed)  # frees an older record
    return agreed


cdef inline int _lookup(const Agreed* agreed, int64_t nbytes) noexcept nogil:
    cdef int i = agreed.nsteps - 1
    while i > 0 and nbytes < agreed.start[i]:
        i -= 1
    return agreed.path[i]


cdef int _decide(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                 const Reduction* red, int kind) except -1:
    if not red.predefined or red.divide_kind >= 0:  # computed on the host by fastreduce
        return PATH_STAGED
    if choose_algorithm(plan_for(handle), nbytes) != FR_ALGO_MPI:  # combines on the host
        return PATH_STAGED
    cdef const Agreed* agreed = _agreed(comm, handle)
    if agreed.mode == MODE_STAGED:
        return PATH_STAGED
    if not (agreed.nonblocking if nonblocking else agreed.blocking):
        return PATH_STAGED
    if (kind == KIND_FLOAT16 or kind == KIND_BFLOAT16) and not agreed.half:
        return PATH_STAGED
    if agreed.mode == MODE_DIRECT:
        return PATH_DIRECT
    return _lookup(agreed, nbytes)


cdef int choose_path(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                     const Reduction* red, int kind) except -1:
    """PATH_DIRECT or PATH_STAGED for one call on CUDA device memory (counted)."""
    cdef int path = _decide(comm, handle, nbytes, nonblocking, red, kind)
    count_path(path == PATH_DIRECT)
    return path
