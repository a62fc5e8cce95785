cdef int raise_mpi_error(int ierr) except -1 with gil

cdef inline int CHKERR(int ierr) except -1 nogil:
    """Raise mpi4py.MPI.Exception for an MPI error code; takes the GIL only then."""
    if ierr == 0:
        return 0
    return raise_mpi_error(ierr)
