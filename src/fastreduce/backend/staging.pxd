# All-reduce of CUDA memory, direct or staged (see _staged.pyx).

from libc.stdint cimport int64_t

from .buffer cimport BufferView
from .cudart cimport Staging, cudaStream_t
from .engine cimport Job
from .libmpi cimport MPI_Comm
from .reductions cimport Reduction

cdef int _check_capture(BufferView* x, BufferView* result) except -1
cdef int _wait_producers(BufferView* x, BufferView* result) except -1
cdef int _wait_out_producer(BufferView* x, BufferView* result) except -1
cdef int _copy_in_whole(Staging* ctx, BufferView* x, size_t nbytes,
                        cudaStream_t stream) except -1 nogil
cdef void _drain(Staging* ctx, cudaStream_t stream) noexcept
cdef int _device_run(BufferView* x, BufferView* result, const void* sendbuf,
                     const Reduction* red, MPI_Comm handle, object comm) except -1
cdef int _pipeline_begin(Staging* ctx, cudaStream_t stream, const char* src, int64_t nbytes,
                         int64_t chunk) except -1 nogil
cdef int _pipeline_end(Staging* ctx, cudaStream_t stream, bint own_stream) except -1 nogil


cdef class _StagedJob(Job):
    # A non-blocking staged reduction for the progress engine.
    cdef Staging* ctx
    cdef const char* src
    cdef char* dst
    cdef int64_t nbytes
    cdef int64_t chunk
    cdef const Reduction* red
    cdef object dup           # the communicator's duplicate the engine reduces on
    cdef object keep          # tensors and export capsules, alive until the job is released
    cdef cudaStream_t stream  # the producer's stream
    cdef bint own_stream
    cdef int64_t segment_bytes  # the segment size when it was started (the same on every rank)
    cdef object start_error     # starting it failed here: the job only takes part, then fails

    cdef int _make_up(self, MPI_Comm handle, int64_t reduced) except -1
