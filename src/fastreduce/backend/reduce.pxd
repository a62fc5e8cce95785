# All-reduce of host memory with MPI (see _reduce.pyx).

from libc.stdint cimport int64_t

from .libmpi cimport MPI_Comm
from .reductions cimport Reduction

cdef int _run(const void* sendbuf, char* recvbuf, int64_t count, const Reduction* red,
              MPI_Comm comm) except -1
cdef int _run_in(const void* sendbuf, char* recvbuf, int64_t count, const Reduction* red,
                 MPI_Comm comm, int64_t segment_bytes) except -1
cdef int64_t segment_bytes_now() noexcept nogil
cdef int64_t count_limit() noexcept nogil
