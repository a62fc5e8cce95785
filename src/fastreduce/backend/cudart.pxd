# The CUDA runtime, loaded at run time (no build-time CUDA): streams, events,
# counted copies, cached pinned staging memory, and the staging planner.

from libc.stdint cimport int64_t

ctypedef void* cudaStream_t
ctypedef void* cudaEvent_t

cdef enum:
    MEMCPY_H2D = 1
    MEMCPY_D2H = 2
    STAGING_SLOTS = 4  # ring slots of a pipelined staged reduction

ctypedef struct Staging:
    # One staging context: fastreduce's own streams and events, and pinned host
    # memory. Contexts are cached per device and reused; a context is held by
    # one call (or one pending request) at a time.
    int device
    cudaStream_t d2h_stream
    cudaStream_t h2d_stream
    cudaEvent_t start                # recorded on the producer's stream
    cudaEvent_t done                 # the last GPU use of `host`
    cudaStream_t done_stream         # ... recorded on this stream
    cudaEvent_t d2h[STAGING_SLOTS]
    cudaEvent_t h2d[STAGING_SLOTS]
    char* host                       # pinned (cudaHostAlloc)
    size_t capacity
    Staging* next

cdef int require_device(int device_type, int device_id, str role) except -1
cdef cudaStream_t consumer_stream(int device_id) except? NULL
cdef int check_not_capturing(cudaStream_t stream, str role) except -1
cdef int use_device(int device) except -1 nogil

cdef Staging* staging_take(int device_id, size_t nbytes) except NULL
cdef void staging_give(Staging* ctx) noexcept
cdef int64_t chunk_bytes(int64_t nbytes) noexcept nogil
cdef int64_t movement_chunk_bytes(int64_t nbytes, bint pipelines_small) noexcept nogil

cdef int copy_async(void* dst, const void* src, size_t nbytes, int kind,
                    cudaStream_t stream) except -1 nogil
cdef int stream_sync(cudaStream_t stream) except -1 nogil
cdef int event_record(cudaEvent_t event, cudaStream_t stream) except -1 nogil
cdef int event_sync(cudaEvent_t event) except -1 nogil
cdef int stream_wait_event(cudaStream_t stream, cudaEvent_t event) except -1 nogil
cdef int staging_order(Staging* ctx, cudaStream_t stream) except -1 nogil
cdef int staging_release(Staging* ctx, cudaStream_t stream) except -1 nogil
