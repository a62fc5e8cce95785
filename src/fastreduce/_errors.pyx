"""MPI error codes as Python exceptions, and what MPI this extension was built with."""

from ._libmpi cimport (
    FR_MPI_BUILD_VERSION,
    FR_MPI_FAMILY,
    MPI_Get_library_version,
    MPI_MAX_LIBRARY_VERSION_STRING,
)

from mpi4py import MPI


cdef int raise_mpi_error(int ierr) except -1 with gil:
    raise MPI.Exception(ierr)


def build_mpi() -> tuple:
    """(family, version) of the MPI headers this extension was compiled against."""
    return (FR_MPI_FAMILY.decode(), FR_MPI_BUILD_VERSION.decode())


def linked_library_version() -> str:
    """MPI_Get_library_version() as answered by the libmpi this extension calls."""
    cdef char buf[MPI_MAX_LIBRARY_VERSION_STRING + 1]
    cdef int length = 0
    CHKERR(MPI_Get_library_version(buf, &length))
    return buf[:length].decode(errors="replace")
