# A record the ranks of a communicator agreed on (an algorithm plan, GPU path settings),
# kept in an MPI attribute of the communicator and tagged with the generation of the
# settings it was agreed under: later calls cost one attribute look-up, and a changed
# setting (a new generation) makes the communicator agree again.

from libc.stdint cimport int64_t

from .libmpi cimport *
from .mpierrors cimport CHKERR

ctypedef struct RecordHead:
    int64_t generation  # the first member of every record kept this way


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
