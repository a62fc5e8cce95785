# A record the ranks of a communicator agreed on (an algorithm plan, GPU path settings),
# kept in an MPI attribute of the communicator and tagged with the generation of the
# settings it was agreed under: later calls cost one attribute look-up, and a changed
# setting (a new generation) makes the communicator agree again. Such a record holds a
# size table (StepTable: a choice per message size). The Python side of an agreement
# (set_agreement, forget, the generation) is agreement.pxi, included by the modules that
# keep records.

from libc.stdint cimport int64_t

from .libmpi cimport *
from .mpierrors cimport CHKERR

cdef enum:
    MAX_TABLE_STEPS = 64

ctypedef struct RecordHead:
    int64_t generation  # the first member of every record kept this way

ctypedef struct StepTable:
    # a choice per message size: from start[i] bytes up to start[i + 1], choice[i]
    int nsteps
    int64_t start[MAX_TABLE_STEPS]
    int choice[MAX_TABLE_STEPS]


cdef inline void* cached_record(MPI_Comm handle, int* keyval,
                                MPI_Comm_delete_attr_function* free_record,
                                int64_t generation) except? NULL:
    """The communicator's record if it was agreed under `generation`, else NULL; the
    keyval (freeing records with free_record) is made at first use."""
    cdef void* value = NULL
    cdef int found = 0
    if keyval[0] == MPI_KEYVAL_INVALID:
        CHKERR(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_record, keyval, NULL))
    CHKERR(MPI_Comm_get_attr(handle, keyval[0], &value, &found))
    if found and (<RecordHead*>value).generation == generation:
        return value
    return NULL


cdef inline int keep_record(MPI_Comm handle, int keyval,
                            MPI_Comm_delete_attr_function* free_record,
                            void* record) except -1:
    """Attach record to the communicator (the attribute frees the record it replaces); if
    MPI refuses, free record and raise."""
    cdef int ierr = MPI_Comm_set_attr(handle, keyval, record)
    if ierr != MPI_SUCCESS:
        free_record(handle, keyval, record, NULL)
        CHKERR(ierr)
    return 0


cdef inline int fill_steps(StepTable* table, steps, dict codes, int most,
                           str what) except -1:
    """Fill table from agreed steps ((start bytes, choice name), ...), each name's code from
    codes; ValueError unless there are 1 to `most` (at most MAX_TABLE_STEPS) of them."""
    if not 1 <= len(steps) <= min(most, MAX_TABLE_STEPS):
        raise ValueError(f"fastreduce: {what} has 1 to {min(most, MAX_TABLE_STEPS)} steps, "
                         f"not {len(steps)}")
    table.nsteps = len(steps)
    for i, (start, name) in enumerate(steps):
        table.start[i] = start
        table.choice[i] = codes[name]
    return 0


cdef inline int step_choice(const StepTable* table, int64_t nbytes) noexcept nogil:
    """The table's choice for a message of nbytes."""
    cdef int i = table.nsteps - 1
    while i > 0 and nbytes < table.start[i]:
        i -= 1
    return table.choice[i]
