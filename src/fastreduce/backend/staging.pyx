"""All-reduce of CUDA memory: direct (the device pointer to MPI) or staged through pinned
host memory, pipelined in chunks, with the stream ordering both need; and the progress
engine's job for a non-blocking staged request.
"""

from mpi4py cimport MPI

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport calloc, free

from .buffer cimport BufferView
from .cudart cimport (
    MEMCPY_D2H, MEMCPY_H2D, STAGING_SLOTS, Staging, check_not_capturing, chunk_bytes,
    consumer_stream, copy_async, cudaStream_t, event_record, event_sync, require_device,
    staging_give, staging_order, staging_release, staging_take, stream_sync, stream_wait_event,
    use_device,
)
from .dlpack cimport kDLCUDA, kDLCUDAManaged
from .dtypes cimport KIND_FLOAT32
from .engine cimport Job
from .mpierrors cimport CHKERR
from .pathchoice cimport PATH_DIRECT, PATH_STAGED, choose_path
from .libmpi cimport *
from .reductions cimport OP_SUM, Reduction, get_reduction
from .reduce cimport _run, _run_in, segment_bytes_now

import time

from .cudart import current_device

# --- GPU memory ---------------------------------------------------------------------
#
# Three ways, chosen per call:
# - managed memory: the host can read it once the producer's stream is done;
# - direct: the device pointer goes to MPI after the producer's stream is done; no
#   copies. Only where the MPI promises to take device pointers for that call
#   (blocking or not, 16-bit or not) and with MPI's own ops, and where the mode
#   and size table choose it (pathchoice.choose_path);
# - staged: device -> pinned host on the producer's stream, MPI on the host,
#   host -> device; large messages in a ring of pipelined chunks (_cuda.chunk_bytes).
# Results are ordered before later work on the producer's stream; when the stream
# is fastreduce's own (producers without the C exchange API) the call also waits
# for them on the host, since the producer's later work is on a stream we do not know.
# Nothing is queued on a stream that is being captured into a CUDA graph.

cdef int _check_capture(BufferView* x, BufferView* result) except -1:
    """RuntimeError when x's (or result's) stream is capturing a CUDA graph."""
    check_not_capturing(<cudaStream_t>x.stream, "x")
    if result.stream != x.stream:
        check_not_capturing(<cudaStream_t>result.stream, "out")
    return 0


cdef int _wait_producers(BufferView* x, BufferView* result) except -1:
    """Host-wait for the work queued on x's (and result's) stream, for a direct call."""
    with nogil:
        stream_sync(<cudaStream_t>x.stream)
    return _wait_out_producer(x, result)


cdef int _wait_out_producer(BufferView* x, BufferView* result) except -1:
    """An out from another producer (another stream): host-wait for its queued work."""
    if result.stream != x.stream:
        with nogil:
            stream_sync(<cudaStream_t>result.stream)
    return 0


cdef int _copy_in_whole(Staging* ctx, BufferView* x, size_t nbytes,
                        cudaStream_t stream) except -1 nogil:
    """x to the context's pinned memory on x's stream, and wait on the host until it is there."""
    staging_order(ctx, stream)  # the buffer's last reader has finished
    if nbytes:
        copy_async(ctx.host, x.data, nbytes, MEMCPY_D2H, stream)
    return stream_sync(stream)


cdef void _drain(Staging* ctx, cudaStream_t stream) noexcept:
    """After an error part-way: let the context's copies finish before it is reused."""
    try:
        with nogil:
            stream_sync(stream)
            stream_sync(ctx.d2h_stream)
            stream_sync(ctx.h2d_stream)
            event_sync(ctx.done)
    except BaseException:  # noqa: BLE001  (the first error is the one to report)
        pass


cdef int _device_run(BufferView* x, BufferView* result, const void* sendbuf,
                     const Reduction* red, MPI_Comm handle, object comm) except -1:
    """Blocking all-reduce of GPU memory x into result (sendbuf: MPI_IN_PLACE or x's data)."""
    _check_capture(x, result)
    if x.device_type == kDLCUDAManaged:
        _wait_producers(x, result)
        return _run(sendbuf, result.data, x.count, red, handle)
    cdef int path = choose_path(comm, handle, x.count * red.itemsize, False, red, x.kind)
    return _device_run_path(x, result, sendbuf, red, handle, path)


cdef int _device_run_path(BufferView* x, BufferView* result, const void* sendbuf,
                          const Reduction* red, MPI_Comm comm, int path) except -1:
    """_device_run by the given path (PATH_DIRECT or PATH_STAGED)."""
    if path == PATH_DIRECT:
        _wait_producers(x, result)
        return _run(sendbuf, result.data, x.count, red, comm)
    _wait_out_producer(x, result)
    cdef int64_t nbytes = x.count * red.itemsize
    cdef int64_t chunk = chunk_bytes(nbytes)
    if nbytes == 0:
        return 0
    if chunk == nbytes:
        return _staged_whole(x, result, red, comm, nbytes)
    return _staged_pipelined(x, result, red, comm, nbytes, chunk)


cdef int _staged_whole(BufferView* x, BufferView* result, const Reduction* red, MPI_Comm comm,
                       int64_t nbytes) except -1:
    """One chunk: copy in and out on the producer's stream, MPI on pinned host memory."""
    cdef cudaStream_t stream = <cudaStream_t>x.stream
    cdef Staging* ctx = staging_take(x.device_id, nbytes)
    try:
        with nogil:
            _copy_in_whole(ctx, x, nbytes, stream)
        _run(MPI_IN_PLACE, ctx.host, x.count, red, comm)
        with nogil:
            copy_async(result.data, ctx.host, nbytes, MEMCPY_H2D, stream)
            staging_release(ctx, stream)
            if x.own_stream:
                event_sync(ctx.done)
    except BaseException:
        _drain(ctx, stream)
        raise
    finally:
        staging_give(ctx)
    return 0


cdef int _stage_in(Staging* ctx, const char* src, int64_t j, int64_t chunk,
                   int64_t nbytes) except -1 nogil:
    """Queue the copy of chunk j to its ring slot on the context's device-to-host stream."""
    cdef int slot = j % STAGING_SLOTS
    copy_async(ctx.host + slot * chunk, src + j * chunk, min(chunk, nbytes - j * chunk),
               MEMCPY_D2H, ctx.d2h_stream)
    return event_record(ctx.d2h[slot], ctx.d2h_stream)


# A pipelined staged reduction, in three parts so that a non-blocking call can queue the
# first on the GPU, leave the second to the progress engine and do the third in wait():
# chunks go through a ring of STAGING_SLOTS pinned slots; while MPI reduces chunk i on the
# host, chunks i+1.. are copied in on one stream and chunk i-1 copied out on another.

cdef int _pipeline_begin(Staging* ctx, cudaStream_t stream, const char* src, int64_t nbytes,
                         int64_t chunk) except -1 nogil:
    """Queue (on the GPU only; the host does not wait) the first copies in, after the work
    queued on the producer's stream so far."""
    cdef int64_t nslots = min(<int64_t>STAGING_SLOTS, (nbytes + chunk - 1) // chunk)
    cdef int64_t j
    event_record(ctx.start, stream)
    stream_wait_event(ctx.d2h_stream, ctx.start)
    staging_order(ctx, ctx.d2h_stream)  # the slots' last reader has finished
    stream_wait_event(ctx.h2d_stream, ctx.start)
    for j in range(nslots):
        _stage_in(ctx, src, j, chunk, nbytes)
    return 0


cdef int _pipeline_run(Staging* ctx, const char* src, char* dst, int64_t nbytes,
                       int64_t chunk, const Reduction* red, MPI_Comm comm,
                       int64_t segment_bytes, int64_t* reduced) except -1:
    """Reduce chunk after chunk as it arrives; queue each copy out. `reduced` counts the
    chunks whose MPI calls were started (for a caller that must make up the rest on
    failure)."""
    cdef int64_t nchunks = (nbytes + chunk - 1) // chunk
    cdef int64_t i, j, n
    cdef int slot
    for i in range(nchunks):
        slot = i % STAGING_SLOTS
        n = min(chunk, nbytes - i * chunk)
        with nogil:
            event_sync(ctx.d2h[slot])
        reduced[0] = i + 1
        _run_in(MPI_IN_PLACE, ctx.host + slot * chunk, n // red.itemsize, red, comm,
                segment_bytes)
        with nogil:
            copy_async(dst + i * chunk, ctx.host + slot * chunk, n, MEMCPY_H2D, ctx.h2d_stream)
            event_record(ctx.h2d[slot], ctx.h2d_stream)
            j = i + STAGING_SLOTS
            if j < nchunks:  # refill the slot once its copy out is done
                stream_wait_event(ctx.d2h_stream, ctx.h2d[slot])
                _stage_in(ctx, src, j, chunk, nbytes)
    with nogil:
        staging_release(ctx, ctx.h2d_stream)
    return 0


cdef int _pipeline_end(Staging* ctx, cudaStream_t stream, bint own_stream) except -1 nogil:
    """Order later work on the producer's stream after the copies out (and, for a stream of
    fastreduce's own, wait for them on the host)."""
    stream_wait_event(stream, ctx.done)
    if own_stream:
        event_sync(ctx.done)
    return 0


cdef int _staged_pipelined(BufferView* x, BufferView* result, const Reduction* red,
                           MPI_Comm comm, int64_t nbytes, int64_t chunk) except -1:
    """A blocking pipelined staged reduction of x into result."""
    cdef cudaStream_t stream = <cudaStream_t>x.stream
    cdef int64_t nslots = min(<int64_t>STAGING_SLOTS, (nbytes + chunk - 1) // chunk)
    cdef int64_t reduced = 0
    cdef Staging* ctx = staging_take(x.device_id, nslots * chunk)
    try:
        with nogil:
            _pipeline_begin(ctx, stream, x.data, nbytes, chunk)
        _pipeline_run(ctx, x.data, result.data, nbytes, chunk, red, comm, segment_bytes_now(),
                      &reduced)
        with nogil:
            _pipeline_end(ctx, stream, x.own_stream)
    except BaseException:
        _drain(ctx, stream)
        raise
    finally:
        staging_give(ctx)
    return 0


cdef class _StagedJob(Job):
    """A non-blocking staged GPU reduction: the engine copies its chunks in, reduces them
    on a duplicate of the communicator and queues the copies out; wait() does the rest."""

    def __cinit__(self):
        self.ctx = NULL

    cdef int execute(self) except -1:
        cdef MPI_Comm handle = <MPI_Comm>(<MPI.Comm>self.dup).ob_mpi
        cdef int64_t reduced = 0
        cdef int32_t failed = 0
        error = self.start_error  # starting failed on this rank: take part all the same
        if error is not None:
            failed = 1
            self._make_up(handle, 0)
        else:
            try:
                with nogil:
                    use_device(self.ctx.device)
                _pipeline_run(self.ctx, self.src, self.dst, self.nbytes, self.chunk, self.red,
                              handle, self.segment_bytes, &reduced)
            except BaseException as exc:  # noqa: BLE001  (raised from wait() below)
                error, failed = exc, 1
                self._make_up(handle, reduced)
        # every rank learns whether any rank failed, so that none takes a partial result
        CHKERR(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT32_T, MPI_MAX, handle))
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("fastreduce: a non-blocking all-reduce failed on another rank "
                               "of the communicator (its wait() says why); this result is not "
                               "valid")
        return 0

    cdef int _make_up(self, MPI_Comm handle, int64_t reduced) except -1:
        """After a failure: make the MPI calls of the chunks not reduced yet on zeroed host
        memory, so that the other ranks' engines are not left waiting."""
        cdef int64_t nchunks = (self.nbytes + self.chunk - 1) // self.chunk
        cdef int64_t k, n
        cdef char* scratch = <char*>calloc(1, self.chunk)
        if scratch == NULL:
            raise MemoryError("fastreduce: out of memory")
        try:
            for k in range(reduced, nchunks):
                n = min(self.chunk, self.nbytes - k * self.chunk)
                try:
                    _run_in(MPI_IN_PLACE, scratch, n // self.red.itemsize, self.red, handle,
                            self.segment_bytes)
                except BaseException:  # noqa: BLE001  (the first error is the one reported)
                    pass
        finally:
            free(scratch)
        return 0

    cdef int cleanup(self) except -1:
        """Done: order the producer's stream after the copies out, release the memory."""
        cdef Staging* ctx = self.ctx
        self.ctx = NULL  # taken before any GIL release: a second caller finds nothing to do
        self.keep = None
        if ctx == NULL:
            return 0
        try:
            with nogil:
                use_device(ctx.device)
            if self.error is None:
                with nogil:
                    _pipeline_end(ctx, self.stream, self.own_stream)
            else:
                _drain(ctx, self.stream)
        finally:
            staging_give(ctx)
        return 0


def _time_device_path(comm, size_t device_ptr, int64_t nbytes, str path, int reps) -> list:
    """Seconds of each of `reps` blocking float32 sums of the nbytes of current-device memory
    at device_ptr over comm, all by one path ("direct" or "staged"), each finished on the
    host before the next; for the GPU path calibration. Nothing here checks the MPI's
    promises: the caller does."""
    cdef MPI_Comm handle = <MPI_Comm>(<MPI.Comm>comm).ob_mpi
    cdef int device = 0
    device = current_device()
    require_device(kDLCUDA, device, "the calibration buffer")
    cdef BufferView view
    view.data = <char*>device_ptr
    view.count = nbytes // 4
    view.kind = KIND_FLOAT32
    view.ndim = 1
    view.shape = NULL
    view.device_type = kDLCUDA
    view.device_id = device
    view.api = NULL
    view.on_device = True
    view.stream = consumer_stream(device)
    view.own_stream = True
    cdef const Reduction* red = get_reduction(KIND_FLOAT32, OP_SUM)
    cdef int which = PATH_DIRECT if path == "direct" else PATH_STAGED
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        _device_run_path(&view, &view, MPI_IN_PLACE, red, handle, which)
        times.append(time.perf_counter() - start)
    return times
