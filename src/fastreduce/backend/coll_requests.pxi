# Non-blocking all-reduce: Request, iallreduce_, iallreduce and wait_all (included by
# collectives.pyx).

# Requests not yet completed; the weak set lets a dropped one be collected (its
# __dealloc__ completes it) and lets interpreter exit complete the rest before
# mpi4py finalizes MPI (atexit runs handlers last-registered first).
_pending = weakref.WeakSet()
_orphaned = []  # buffers of requests whose communicator was freed before they completed


@cython.no_gc_clear  # __dealloc__ needs `job` and `keep` even when the request was in a cycle
cdef class Request:
    """A started non-blocking operation (all-reduce, isend, irecv): wait() returns its
    result, test() never blocks.

    The request keeps every tensor it uses alive until it completes. A collective one
    dropped without wait() is completed when it is garbage-collected, or at interpreter
    exit; a dropped isend or irecv, whose peer may never come, is abandoned instead (a
    receive cancelled, a send's memory kept for good); waiting twice returns the same
    result.
    """

    cdef MPI_Request* handles
    cdef int nhandles
    cdef bint pending
    cdef object result
    cdef object keep          # the tensors and export capsules MPI reads and writes
    cdef object comm          # the mpi4py communicator, to notice when it is freed
    cdef char* recvbuf
    cdef int64_t count
    cdef const Reduction* red
    cdef MPI_Comm handle
    cdef Staging* staging     # GPU staged path: pinned memory MPI works on, else NULL
    cdef char* device_dst     # ... and where its result goes on the device
    cdef cudaStream_t stream
    cdef bint own_stream
    cdef Job job              # the progress engine's job, if it runs this request
    cdef list callbacks       # add_done_callback's, for requests MPI completes
    cdef object flight        # its flight-record entry, while a timeout is set
    cdef object writeback     # a Resolved: the result goes into a lazy view when done
    cdef char* result_data    # the torch result's memory when it started (else NULL)
    cdef bint stage_back      # staged: the pinned memory goes back to the device when done
    cdef bint receiving       # a point-to-point receive: `source` tells whose message it was
    cdef bint p2p             # isend or irecv: its completion waits on one peer alone
    cdef MPI_Status status    # a one-handle request's status (a receive's source)
    cdef object late_error    # raised by wait(): completed when its communicator was freed
    cdef object __weakref__

    def __cinit__(self):
        self.handles = NULL
        self.nhandles = 0
        self.pending = False
        self.staging = NULL
        self.result_data = NULL
        self.stage_back = True
        self.receiving = False
        self.p2p = False
        self.status.MPI_SOURCE = -1

    def __dealloc__(self):
        if self.pending and self.job is not None:
            if self.job.done:  # finished: order the stream and release, quietly
                try:
                    self.job.cleanup()
                    if self.job.error is None and self.writeback is not None:
                        (<Resolved>self.writeback).write_back()
                except BaseException:  # noqa: BLE001  (nowhere to report it from here)
                    pass
            else:  # the engine releases it when done; its tensors stay alive until then
                self.job.orphaned = True
            return
        if self.pending and self.handles != NULL:
            if self.comm is not None and (<MPI.Comm>self.comm).ob_mpi == MPI_COMM_NULL:
                # Its communicator was freed under it: some MPIs crash in a wait now.
                # Keep the request's buffers alive for good instead, so MPI can never
                # write into freed memory.
                _orphaned.append(self.keep)
                return
            if self.p2p:  # its peer may never come: cancel a receive, keep a send's memory
                self._abandon()
                free(self.handles)
                return
            with nogil:  # complete it before its buffers go: MPI may still write them
                MPI_Waitall(self.nhandles, self.handles, MPI_STATUSES_IGNORE)
            if self.staging != NULL or self.writeback is not None:
                self._deliver_quietly()  # deliver the result, as wait() would
        free(self.handles)

    cdef void _abandon(self) noexcept:
        """A point-to-point request dropped (or pending at exit): a receive is cancelled
        and completed (its message, if already matched, arrives); a send cannot be taken
        back, so its memory (and pinned buffer) is kept for good, as MPI may still read it."""
        cdef int finalized = 0
        MPI_Finalized(&finalized)
        self.pending = False
        _pending.discard(self)
        if self.receiving and not finalized:
            with nogil:
                MPI_Cancel(&self.handles[0])
                MPI_Waitall(1, self.handles, MPI_STATUSES_IGNORE)
            if self.staging != NULL:  # nothing was copied from it: give it back as it is
                staging_give(self.staging)
                self.staging = NULL
            self.keep = None
        else:
            _orphaned.append(self.keep)
            self.staging = NULL  # never reused: MPI may still read it
        _flight_end(self.flight, False)

    cdef void _deliver_quietly(self) noexcept:
        """For a dropped request: divide, copy out (staged), write a lazy view back and
        release, reporting nothing."""
        cdef int size = 1
        try:
            if self.red.divide_kind >= 0 and MPI_Comm_size(self.handle, &size) == MPI_SUCCESS:
                with nogil:
                    fr_divide(self.recvbuf, self.count, self.red.divide_kind, size)
            if self.staging != NULL:
                self._stage_out()
            if self.writeback is not None:
                (<Resolved>self.writeback).write_back()
        except BaseException:  # noqa: BLE001  (nowhere to report it from here)
            pass
        if self.staging != NULL:
            staging_give(self.staging)
            self.staging = NULL

    cdef int _check_comm(self) except -1:
        _refuse_if_finalized()
        if self.p2p and self.comm is not None and (<MPI.Comm>self.comm).ob_mpi == MPI_COMM_NULL:
            # (a collective one is still MPI's to complete: Open MPI's were completed as the
            # communicator went (coll_lifetime.pxi), MPICH keeps it until they are done)
            raise ValueError(
                "fastreduce: the request's communicator was freed before the request "
                "completed; wait for point-to-point requests before freeing their "
                "communicator (this request can no longer be completed: its tensors are "
                "kept alive so that nothing is overwritten, and its result is not available)")
        return 0

    cdef int _finish(self, int ierr) except -1:
        self.pending = False
        _pending.discard(self)
        _flight_end(self.flight, ierr == MPI_SUCCESS)
        cdef int size = 1
        try:
            CHKERR(ierr)
            if self.red.divide_kind >= 0:
                CHKERR(MPI_Comm_size(self.handle, &size))
                with nogil:
                    fr_divide(self.recvbuf, self.count, self.red.divide_kind, size)
            if self.staging != NULL:
                self._stage_out()
            self._deliver()
        finally:
            if self.staging != NULL:
                staging_give(self.staging)
                self.staging = NULL
            self.keep = None
            self.writeback = None
            self._run_callbacks()
        return 0

    cdef int _deliver(self) except -1:
        """Done without error: the result into a lazy view, and a check that the result
        tensor still has the memory MPI wrote (x.set_() or x.resize_() meanwhile)."""
        cdef BufferView now
        if self.writeback is not None:
            (<Resolved>self.writeback).write_back()
        if self.result_data == NULL:
            return 0
        try:  # (a torch result: its data_ptr, read on any thread whatever its device)
            moved = <char*><size_t>self.result.data_ptr() != self.result_data
        except Exception:  # noqa: BLE001  (no longer readable at all: moved too)
            moved = True
        if moved:
            raise BufferError(
                "fastreduce: the tensor this request writes had its memory replaced "
                "(x.set_()) before the request completed; "
                "the reduced values went to its old memory, which the request kept alive, and "
                "are lost; leave a tensor's storage alone until wait() returns")
        return 0

    cdef void _run_callbacks(self) noexcept:
        """add_done_callback's functions, once the request is finished (errors ignored)."""
        callbacks, self.callbacks = self.callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except BaseException:  # noqa: BLE001  (a callback's error is its own)
                pass

    cdef int _stage_out(self) except -1:
        """Copy the reduced pinned buffer back to the device, on the producer's stream."""
        cdef Staging* ctx = self.staging
        cdef size_t nbytes = self.count * self.red.itemsize if self.stage_back else 0
        try:
            with nogil:
                if nbytes:
                    copy_async(self.device_dst, ctx.host, nbytes, MEMCPY_H2D, self.stream)
                staging_release(ctx, self.stream)
                if self.own_stream:
                    event_sync(ctx.done)
        except BaseException:
            _drain(ctx, self.stream)
            raise
        return 0

    cdef int _finish_job(self) except -1:
        """The engine has run the job: order the caller's stream after its copies out."""
        self.pending = False
        _pending.discard(self)
        error = self.job.error
        _flight_end(self.flight, error is None)
        try:
            self.job.cleanup()
            if error is None:
                self._deliver()
        finally:
            self.keep = None
            self.writeback = None
        if error is not None:
            raise error
        return 0

    def wait(self):
        """Block until the operation is done (GIL released) and return the result tensor."""
        cdef int ierr
        cdef MPI_Status* statuses
        if self.flight is not None and self.pending:
            _flight_waiting(self.flight)
        if self.pending and self.job is not None:
            wait_for(self.job)
            if self.pending:  # (another thread may have finished it meanwhile)
                self._finish_job()
        elif self.pending:
            self._check_comm()
            statuses = &self.status if self.nhandles == 1 else MPI_STATUSES_IGNORE
            with nogil:
                ierr = MPI_Waitall(self.nhandles, self.handles, statuses)
            self._finish(ierr)
        if self.late_error is not None:
            raise self.late_error
        return self.result

    def test(self) -> bool:
        """Whether the operation is done (advancing it); never blocks."""
        cdef int flag = 0
        cdef int ierr
        if not self.pending:
            return True
        if self.job is not None:
            if not self.job.done:
                return False
            self._finish_job()
            return True
        self._check_comm()
        ierr = MPI_Testall(self.nhandles, self.handles, &flag,
                           &self.status if self.nhandles == 1 else MPI_STATUSES_IGNORE)
        if ierr != MPI_SUCCESS or flag:
            self._finish(ierr)
            return True
        return False

    def add_done_callback(self, fn) -> None:
        """Call fn(request) once the operation is done: at once if it is; for a request of
        the progress engine from its thread when it finishes (wait() then returns at once),
        for others from the wait() or test() that sees it complete."""
        if not self.pending:
            fn(self)
        elif self.job is not None:
            self.job.add_done_callback(lambda job: fn(self))
        else:
            if self.callbacks is None:
                self.callbacks = []
            self.callbacks.append(fn)

    @property
    def engine(self) -> bool:
        """True when fastreduce's progress engine carries this request out."""
        return self.job is not None

    @property
    def done(self) -> bool:
        """True once wait() or test() has seen the operation complete."""
        return not self.pending

    @property
    def source(self) -> int:
        """A completed receive's sender (irecv), else -1."""
        return self.status.MPI_SOURCE if self.receiving and not self.pending else -1


cdef bint _by_engine(int64_t count, const Reduction* red) except -1:
    """Whether the progress engine runs a host request (else MPI_Iallreduce): above its
    size threshold, and always for a 16-bit wire, which MPI_Iallreduce cannot carry."""
    if red.wire != FR_WIRE_NONE:
        _need_engine_for_wire()
        return True
    return host_enabled(count * red.itemsize)


cdef int _need_engine_for_wire() except -1:
    if not enabled():
        raise ValueError(f"fastreduce: a compressed non-blocking all-reduce runs on the "
                         f"progress engine, which is off ({_engine_state()[1]}); use the "
                         f"blocking allreduce_ with compression, or reduce without it")
    return 0


cdef Request _start(const void* sendbuf, char* recvbuf, int64_t count, const Reduction* red,
                    MPI_Comm handle, object comm, object result, object keep):
    """MPI_Iallreduce (large-count, or chunked past the int limit) wrapped in a Request."""
    if red.wire != FR_WIRE_NONE:  # MPI_Iallreduce cannot carry a 16-bit wire
        raise ValueError("fastreduce: a compressed non-blocking all-reduce of this memory "
                         "would go to MPI_Iallreduce, which cannot send 16 bits; use the "
                         "blocking allreduce_ with compression (or the progress engine)")
    cdef Request req = Request.__new__(Request)
    cdef int64_t limit = count_limit()
    cdef int64_t chunks = 1
    if count > limit and not (red.predefined and fr_have_large_count()):
        chunks = (count + limit - 1) // limit
    req.handles = <MPI_Request*>malloc(chunks * sizeof(MPI_Request))
    if req.handles == NULL:
        raise MemoryError("fastreduce: out of memory for MPI requests")
    req.result, req.keep, req.comm = result, keep, comm
    req.recvbuf, req.count, req.red, req.handle = recvbuf, count, red, handle
    cdef int ierr = MPI_SUCCESS
    cdef int64_t offset = 0
    cdef int64_t n
    cdef int64_t stride = red.itemsize
    cdef int started = 0
    with nogil:
        if count <= limit:
            ierr = MPI_Iallreduce(sendbuf, recvbuf, <int>count, red.datatype, red.op, handle,
                                  &req.handles[0])
            started = ierr == MPI_SUCCESS
        elif chunks == 1:
            ierr = fr_iallreduce_large(sendbuf, recvbuf, count, red.datatype, red.op, handle,
                                       &req.handles[0])
            started = ierr == MPI_SUCCESS
        else:
            while offset < count and ierr == MPI_SUCCESS:
                n = min(limit, count - offset)
                ierr = MPI_Iallreduce(
                    sendbuf if sendbuf == MPI_IN_PLACE else <const char*>sendbuf + offset * stride,
                    recvbuf + offset * stride, <int>n, red.datatype, red.op, handle,
                    &req.handles[started])
                if ierr == MPI_SUCCESS:
                    started += 1
                offset += n
    req.nhandles = started
    if started:
        req.pending = True
        _pending.add(req)
    if ierr != MPI_SUCCESS:
        if started:  # complete the chunks that did start before reporting the error
            with nogil:
                MPI_Waitall(started, req.handles, MPI_STATUSES_IGNORE)
            req.pending = False
            _pending.discard(req)
        CHKERR(ierr)
    return req


def iallreduce_(x, op="sum", *, comm=None, compression=None):
    """Start reducing x in place over comm; returns a Request whose wait() returns x."""
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    owner = _prepare(x, op, comm, True, &view, &handle, &red, compression)
    if _debug:
        _debug_check(comm, "iallreduce_", &view, op)
    _agreed(handle)
    storage = _storage(x, &view)
    keep = (x, owner, storage)
    cdef Request req = _iallreduce_inplace(x, comm, keep, &view, handle, red)
    _guard(req, &view, owner)
    if _recording:
        return _recorded(req, comm, "iallreduce_", &view)
    return req


cdef object _storage(object x, BufferView* view):
    """What keeps x's memory itself alive: for torch (whose x.set_() swaps the storage
    under the tensor object) its storage; else the object and its export suffice. (torch's
    x.resize_() to a larger size frees the memory inside the storage: nothing outside torch
    can keep that alive; see the README.)"""
    if view.torch and not view.lazy:
        return x.untyped_storage()
    return None


cdef int _guard(Request req, BufferView* result, object owner) except -1:
    """Give a started request what it must do when it completes: write a lazy view's result
    back, or check that a torch result still has the memory MPI wrote."""
    if result.lazy:
        req.writeback = owner
        if not req.pending and req.job is None:  # nothing was in flight: deliver now
            _write_back(owner)
            req.writeback = None
    elif result.torch:
        req.result_data = result.data
    return 0


cdef Request _iallreduce_inplace(object x, object comm, object keep, BufferView* view,
                                 MPI_Comm handle, const Reduction* red):
    if view.on_device:
        return _device_start(view, view, MPI_IN_PLACE, red, handle, comm, x, keep)
    if _by_engine(view.count, red):
        return _engine_host_start(MPI_IN_PLACE, view.data, view.count, red, comm, x, keep)
    return _start(MPI_IN_PLACE, view.data, view.count, red, handle,
                  default_comm() if comm is None else comm, x, keep)


def iallreduce(x, op="sum", *, comm=None, out=None, compression=None):
    """Start reducing x over comm into a new tensor (or `out`); returns a Request; x is kept."""
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    owner = _prepare(x, op, comm, False, &view, &handle, &red, compression)
    out_owner = None
    given = out is not None
    if given:
        out_owner = _prepare_out(out, &view, &result)
    else:
        out = new_like(x, &view, &result)
    cdef const void* sendbuf = _send_buffer(&view, &result, red)
    if _debug:
        _debug_check(comm, "iallreduce", &view, op)
    _agreed(handle)
    storage = _storage(out, &result) if given else None
    keep = (x, owner, out, out_owner, _storage(x, &view), storage)
    cdef Request req = _iallreduce_new(comm, out, keep, &view, &result, sendbuf, handle, red)
    if given:
        _guard(req, &result, out_owner)
    if _recording:
        return _recorded(req, comm, "iallreduce", &view)
    return req


cdef Request _iallreduce_new(object comm, object out, object keep, BufferView* view,
                             BufferView* result, const void* sendbuf, MPI_Comm handle,
                             const Reduction* red):
    if view.on_device:
        return _device_start(view, result, sendbuf, red, handle, comm, out, keep)
    if _by_engine(view.count, red):
        return _engine_host_start(sendbuf, result.data, view.count, red, comm, out, keep)
    return _start(sendbuf, result.data, view.count, red, handle,
                  default_comm() if comm is None else comm, out, keep)


cdef Request _recorded(Request req, object comm, str call, BufferView* view):
    """Give a started request its flight-record entry (done at once if nothing is pending)."""
    req.flight = _flight_begin(comm, call, view.count, view.kind, False)
    if not req.pending:
        _flight_end(req.flight, True)
    return req


cdef Request _device_start(BufferView* x, BufferView* result, const void* sendbuf,
                           const Reduction* red, MPI_Comm handle, object comm, object out,
                           object keep):
    """Start a non-blocking all-reduce of GPU memory: direct, or staged through pinned
    memory (copied in now; copied out by the wait or test that sees MPI finish)."""
    _check_capture(x, result)
    cdef bint direct = x.device_type == kDLCUDAManaged
    if not direct:
        direct = choose_path(comm, handle, x.count * red.itemsize, True, red,
                             x.kind) == PATH_DIRECT
    if comm is None:
        comm = default_comm()
    if direct:
        _wait_producers(x, result)
        return _start(sendbuf, result.data, x.count, red, handle, comm, out, keep)
    cdef cudaStream_t stream = <cudaStream_t>x.stream
    cdef size_t nbytes = x.count * red.itemsize
    _wait_out_producer(x, result)
    if nbytes and enabled():
        return _engine_start(x, result, red, comm, out, keep)
    cdef Staging* ctx = staging_take(x.device_id, nbytes)
    cdef Request req
    try:
        with nogil:
            _copy_in_whole(ctx, x, nbytes, stream)
        req = _start(MPI_IN_PLACE, ctx.host, x.count, red, handle, comm, out, keep)
    except BaseException:
        _drain(ctx, stream)
        staging_give(ctx)
        raise
    req.staging = ctx
    req.device_dst = result.data
    req.stream = stream
    req.own_stream = x.own_stream
    if not req.pending:  # nothing in flight (e.g. zero elements): deliver now
        req._finish(MPI_SUCCESS)
    return req


def wait_all(requests) -> list:
    """Wait for every request (one MPI_Waitall, GIL released); returns their results in order."""
    requests = list(requests)
    cdef Request req
    cdef int total = 0
    for obj in requests:
        if not isinstance(obj, Request):
            raise TypeError(f"fastreduce: wait_all takes fastreduce Requests, not "
                            f"{type(obj).__qualname__}")
    results = requests
    requests = list({id(obj): obj for obj in requests}.values())  # each once: MPI_Waitall
    for obj in requests:                                           # of a handle twice hangs
        req = <Request>obj
        if req.pending and req.job is None:
            req._check_comm()
            total += req.nhandles
    cdef MPI_Request* handles = <MPI_Request*>malloc(max(total, 1) * sizeof(MPI_Request))
    if handles == NULL:
        raise MemoryError("fastreduce: out of memory for MPI requests")
    cdef int i, at = 0
    cdef int ierr
    try:
        for obj in requests:
            req = <Request>obj
            if req.pending and req.job is None:
                for i in range(req.nhandles):
                    handles[at + i] = req.handles[i]
                at += req.nhandles
        with nogil:
            ierr = MPI_Waitall(total, handles, MPI_STATUSES_IGNORE)
        at = 0
        for obj in requests:
            req = <Request>obj
            if req.pending and req.job is None:
                for i in range(req.nhandles):  # completed handles are now MPI_REQUEST_NULL
                    req.handles[i] = handles[at + i]
                at += req.nhandles
                req._finish(ierr)
    finally:
        free(handles)
    for obj in requests:  # the progress engine's requests
        if (<Request>obj).pending:
            obj.wait()
    return [(<Request>obj).result for obj in results]


def _complete_pending_requests() -> None:
    """At interpreter exit, before MPI is finalized: complete every request still in flight
    (point-to-point ones, whose peer may never come, are abandoned: see Request._abandon)."""
    for req in list(_pending):
        if (<Request>req).p2p and (<Request>req).pending:
            (<Request>req)._abandon()
            continue
        try:
            req.wait()
        except Exception:  # noqa: BLE001  (exit must go on; the error was the user's)
            pass


atexit.register(_complete_pending_requests)
