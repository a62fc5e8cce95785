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
    /* The MPI's own CUDA-support query, looked up at run time in the MPI loaded (as the
     * large-count calls are: mpicompat.h): MPICH's MPIX_GPU_query_support (CUDA is 0 in
     * its enumeration), else MPIX_Query_cuda_support (Open MPI's CUDA extension, MPICH).
     * Returns 2 or 1 for the one that answered, 0 where the MPI has neither. */
    typedef int (*fr_gpu_query_fn)(int, int *);
    typedef int (*fr_cuda_query_fn)(void);
    static int fr_cuda_query(int *answer) {
      fr_gpu_query_fn gpu = (fr_gpu_query_fn)fr_mpi_symbol("MPIX_GPU_query_support");
      fr_cuda_query_fn cuda = (fr_cuda_query_fn)fr_mpi_symbol("MPIX_Query_cuda_support");
      *answer = 0;
      if (gpu != NULL) return gpu(0, answer) == MPI_SUCCESS ? 2 : 0;
      if (cuda != NULL) { *answer = cuda(); return 1; }
      return 0;
    }
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
