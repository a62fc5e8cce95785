# The progress engine's requests: its jobs and its duplicate communicators (included by
# collectives.pyx).

cdef class _HostJob(Job):
    """A non-blocking host all-reduce run by the progress engine: blocking (segmented)
    MPI calls on a duplicate of the communicator, off the caller's thread."""

    cdef const void* sendbuf
    cdef char* recvbuf
    cdef int64_t count
    cdef const Reduction* red
    cdef object dup
    cdef object keep
    cdef int64_t segment_bytes  # when it was started: the same on every rank

    cdef int execute(self) except -1:
        return _run_in(self.sendbuf, self.recvbuf, self.count, self.red,
                       <MPI_Comm>(<MPI.Comm>self.dup).ob_mpi, self.segment_bytes)

    cdef int cleanup(self) except -1:
        self.keep = None
        return 0


cdef Request _engine_host_start(const void* sendbuf, char* recvbuf, int64_t count,
                                const Reduction* red, object comm, object out, object keep):
    cdef _HostJob job = _HostJob.__new__(_HostJob)
    job.sendbuf, job.recvbuf, job.count, job.red = sendbuf, recvbuf, count, red
    job.dup, job.keep = _engine_comm(comm), keep
    job.segment_bytes = segment_bytes_now()
    cdef Request req = Request.__new__(Request)
    req.job, req.result, req.keep, req.pending = job, out, keep, True
    _pending.add(req)
    submit(job)
    return req


cdef class _FreeComm(Job):
    """Free a duplicate communicator once the jobs queued before on it are done."""

    cdef object comm

    cdef int execute(self) except -1:
        self.comm.Free()
        return 0


_dup_keyval = None


def _free_duplicate(dup) -> None:
    """The communicator is being freed: free the engine's duplicate after its queued jobs
    (a commattr callback: an mpi4py one would ask MPI about the communicator mid-free)."""
    cdef _FreeComm job = _FreeComm.__new__(_FreeComm)
    job.comm = dup
    job.orphaned = True  # nobody waits for it
    submit(job)


cdef object _engine_comm(object comm):
    """The engine's duplicate of comm (made at its first engine request: collective)."""
    global _dup_keyval
    if comm is None:
        comm = default_comm()
    if _dup_keyval is None:
        _dup_keyval = _create_keyval(_free_duplicate)
    dup = _get_attr(comm, _dup_keyval)
    if dup is None:
        with _setup_recorded("MPI_Comm_dup: the progress engine's", comm):
            dup = comm.Dup()
        dup.Set_errhandler(_MPI.ERRORS_RETURN)
        _set_attr(comm, _dup_keyval, dup)
    return dup


cdef Request _engine_start(BufferView* x, BufferView* result, const Reduction* red,
                           object comm, object out, object keep):
    """Start a staged request on the progress engine: queue the first copies in on the GPU
    (the host does not wait) and the rest of the job on the engine."""
    cdef cudaStream_t stream = <cudaStream_t>x.stream
    cdef int64_t nbytes = x.count * red.itemsize
    cdef int64_t chunk = chunk_bytes(nbytes)
    cdef int64_t nslots = min(<int64_t>STAGING_SLOTS, (nbytes + chunk - 1) // chunk)
    dup = _engine_comm(comm)
    cdef _StagedJob job = _StagedJob.__new__(_StagedJob)
    job.src, job.dst, job.nbytes, job.chunk = x.data, result.data, nbytes, chunk
    job.red, job.dup, job.keep = red, dup, keep
    job.stream, job.own_stream = stream, x.own_stream
    job.segment_bytes = segment_bytes_now()
    cdef Staging* ctx = NULL
    try:
        ctx = staging_take(x.device_id, nslots * chunk)
        with nogil:
            _pipeline_begin(ctx, stream, x.data, nbytes, chunk)
        job.ctx = ctx
    except Exception as exc:  # noqa: BLE001  (the job still takes part, then fails everywhere)
        if ctx != NULL:
            _drain(ctx, stream)
            staging_give(ctx)
        job.start_error = exc
    cdef Request req = Request.__new__(Request)
    req.job, req.result, req.keep, req.pending = job, out, keep, True
    _pending.add(req)
    submit(job)
    return req


def engine_comm(comm=None):
    """The progress engine's duplicate of comm (collective over comm at its first use)."""
    return _engine_comm(comm)
