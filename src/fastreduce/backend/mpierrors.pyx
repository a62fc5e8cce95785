"""MPI error codes as Python exceptions, and what MPI this extension was built with."""

from .libmpi cimport (
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
    return buf[:length].decode(errors="replace").rstrip("\0")


cdef extern from *:
    """
    #if defined(OPEN_MPI) && OPEN_MPI && defined(OMPI_HAVE_MPI_EXT_CUDA) && OMPI_HAVE_MPI_EXT_CUDA
    #define FR_CUDA_QUERY 1
    static int fr_cuda_query(int *answer) { *answer = MPIX_Query_cuda_support(); return 1; }
    #elif defined(MPICH) && defined(MPIX_GPU_SUPPORT_CUDA)
    #define FR_CUDA_QUERY 2
    static int fr_cuda_query(int *answer) {
      return MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, answer) == MPI_SUCCESS ? 2 : 0;
    }
    #else
    #define FR_CUDA_QUERY 0
    static int fr_cuda_query(int *answer) { *answer = 0; return 0; }
    #endif
    """
    int fr_cuda_query(int* answer)


def mpi_cuda_query():
    """(answer, how) from the MPI's own CUDA-support query, or None when it has none."""
    cdef int answer = 0
    cdef int which = fr_cuda_query(&answer)
    if which == 1:
        return bool(answer), "MPIX_Query_cuda_support()"
    if which == 2:
        return bool(answer), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)"
    return None
