# cython: warn.unused=False
# (the `_owner` locals are unused on purpose: they keep DLPack export capsules,
# and so the memory MPI works on, alive until the call returns)
"""All-reduce of DLPack tensors: blocking, non-blocking (Request) and coalesced.

The GIL is released around every MPI call that can wait for other ranks.
"""

cimport cython
from mpi4py cimport MPI

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from .buffer cimport BufferView, Resolved, acquire, check_same_layout, device_name, new_like
from .cudart cimport (
    MEMCPY_D2H, MEMCPY_H2D, STAGING_SLOTS, Staging, check_not_capturing, chunk_bytes,
    copy_async, cudaStream_t, event_sync, staging_give, staging_order, staging_release,
    staging_take, stream_sync,
)
from .dlpack cimport kDLCUDA, kDLCUDAManaged
from .dtypes cimport NKINDS
from .engine cimport Job, enabled, host_enabled, submit, wait_for
from .mpierrors cimport CHKERR
from .pathchoice cimport PATH_DIRECT, choose_path
from .libmpi cimport *
from .reductions cimport OP_AVG, OP_SUM, Reduction, get_reduction, op_code
from .reduce cimport _run, _run_in, count_limit, segment_bytes_now
from .staging cimport (
    _check_capture, _copy_in_whole, _device_run, _drain, _pipeline_begin, _StagedJob,
    _wait_out_producer, _wait_producers,
)

import atexit
import weakref
from contextlib import nullcontext

from mpi4py import MPI as _MPI

cdef extern from "halfops.h" nogil:
    void fr_divide(void* data, int64_t count, int kind, int divisor)

cdef MPI_Comm _default_handle = MPI_COMM_NULL
cdef object _default_comm = None


def default_comm():
    """The communicator used when comm=None: a duplicate of COMM_WORLD, made once (collective)."""
    global _default_comm, _default_handle
    if _default_comm is None:
        comm = None
        with _setup_recorded("MPI_Comm_dup: the default communicator", _MPI.COMM_WORLD):
            comm = _MPI.COMM_WORLD.Dup()
        comm.Set_errhandler(_MPI.ERRORS_RETURN)
        comm.Set_name("fastreduce default")
        _default_comm = comm
        _default_handle = <MPI_Comm>(<MPI.Comm>comm).ob_mpi
    return _default_comm


cdef int _resolve_comm(object comm, MPI_Comm* out) except -1:
    if comm is None:
        if _default_handle == MPI_COMM_NULL:
            default_comm()
        out[0] = _default_handle
        return 0
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"fastreduce: comm must be an mpi4py intracommunicator or None, not "
                        f"{type(comm).__qualname__}")
    cdef MPI_Comm handle = <MPI_Comm>(<MPI.Comm>comm).ob_mpi
    if handle == MPI_COMM_NULL:
        raise ValueError("fastreduce: comm is MPI.COMM_NULL (freed, or this rank is not in "
                         "it); pass a live intracommunicator, or None for the default")
    cdef int inter = 0
    if not isinstance(comm, MPI.Intracomm):
        CHKERR(MPI_Comm_test_inter(handle, &inter))
        if inter:
            raise ValueError("fastreduce: comm is an intercommunicator; all-reduce here needs "
                             "an intracommunicator (merge it with comm.Merge())")
    out[0] = handle
    return 0


cdef inline object _prepare(object x, object op, object comm, bint writable,
                            BufferView* view, MPI_Comm* handle, const Reduction** red):
    """Validate op, comm and x (in that order, before any MPI call); returns x's owner."""
    cdef int code = op_code(op)
    _resolve_comm(comm, handle)
    owner = acquire(x, view, writable, "x")
    red[0] = get_reduction(view.kind, code)
    return owner


cdef inline object _prepare_out(object out, BufferView* view, BufferView* result):
    """Validate `out` against x's view and fill `result`; returns out's owner (a Resolved
    when out is a lazy view: the result goes to a copy, then into out).

    `out` itself keeps its memory alive: an export that is a copy is refused for writing.
    """
    owner = acquire(out, result, True, "out")
    check_same_layout(view, result)
    return owner


cdef inline int _write_back(object owner) except -1:
    """In-place results reduced in a lazy view's resolved copy: store them into the view."""
    if owner is not None and type(owner) is Resolved:
        (<Resolved>owner).write_back()
    return 0


# --- debug mode (FASTREDUCE_DEBUG=1, fastreduce.set_debug): every rank agrees on each call
cdef bint _debug = False


def _set_debug(bint on) -> None:
    global _debug
    _debug = on


cdef str _op_label(object op):
    """The op as every rank names it (an mpi4py Op by its handle number, not its address)."""
    return op if isinstance(op, str) else f"MPI.Op {op.py2f()}"


cdef int _debug_check(object comm, str call, BufferView* view, object op) except -1:
    """Debug mode: the ranks of comm agree on this call's fingerprint (checks.fingerprint)."""
    from .reductions import KIND_NAMES
    from ..checks import fingerprint

    fingerprint(default_comm() if comm is None else comm, call, count=view.count,
                dtype=KIND_NAMES[view.kind], op=_op_label(op),
                device=device_name(view.device_type, view.device_id).split(":")[0])
    return 0


# --- flight record (FASTREDUCE_TIMEOUT, fastreduce.watchdog): only while a timeout is set
cdef bint _recording = False


def _set_recording(bint on) -> None:
    global _recording
    _recording = on


cdef object _flight_begin(object comm, str call, int64_t count, int kind, bint blocking):
    from .reductions import KIND_NAMES
    from ..watchdog import begin

    return begin(call, comm, count, KIND_NAMES[kind], blocking)


cdef object _setup_recorded(str call, object comm):
    """A context recording a set-up collective while a timeout is set (watchdog.recorded)."""
    if not _recording:
        return nullcontext()
    from ..watchdog import recorded

    return recorded(call, comm)


cdef void _flight_end(object entry, bint ok) noexcept:
    if entry is not None:
        entry.state = "done" if ok else "failed"
        entry.waiting_since = None


cdef int _blocking(BufferView* view, BufferView* result, const void* sendbuf,
                   const Reduction* red, MPI_Comm handle, object comm, str call) except -1:
    """The blocking all-reduce of view into result (host or GPU path), in the flight record
    while a timeout is set."""
    entry = _flight_begin(comm, call, view.count, view.kind, True) if _recording else None
    try:
        if not view.on_device:
            _run(sendbuf, result.data, view.count, red, handle)
        else:
            _device_run(view, result, sendbuf, red, handle, comm)
    except BaseException:
        _flight_end(entry, False)
        raise
    _flight_end(entry, True)
    return 0


def allreduce_(x, op="sum", *, comm=None):
    """Reduce x over all ranks of comm in place (MPI_IN_PLACE) and return x."""
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    _owner = _prepare(x, op, comm, True, &view, &handle, &red)
    if _debug:
        _debug_check(comm, "allreduce_", &view, op)
    _blocking(&view, &view, MPI_IN_PLACE, red, handle, comm, "allreduce_")
    if view.lazy:
        _write_back(_owner)
    return x


cdef const void* _send_buffer(BufferView* view, BufferView* result,
                              const Reduction* red) except? NULL:
    """x's data, or MPI_IN_PLACE when out is x itself; ValueError when they partly overlap."""
    cdef int64_t nbytes = view.count * red.itemsize
    if result.data == view.data:
        return MPI_IN_PLACE
    if nbytes and result.data < view.data + nbytes and view.data < result.data + nbytes:
        raise ValueError("fastreduce: out overlaps x in memory; pass a separate out, or use "
                         "allreduce_ to reduce in place")
    return view.data


def allreduce(x, op="sum", *, comm=None, out=None):
    """Return the reduction of x over all ranks of comm, in a new tensor or in `out`; x is kept."""
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    _owner = _prepare(x, op, comm, False, &view, &handle, &red)
    out_owner = None
    if out is None:
        out = new_like(x, &view, &result)
    else:
        out_owner = _prepare_out(out, &view, &result)
    cdef const void* sendbuf = _send_buffer(&view, &result, red)
    if _debug:
        _debug_check(comm, "allreduce", &view, op)
    _blocking(&view, &result, sendbuf, red, handle, comm, "allreduce")
    if result.lazy:
        _write_back(out_owner)
    return out


# --- non-blocking -------------------------------------------------------------------

# Requests not yet completed; the weak set lets a dropped one be collected (its
# __dealloc__ completes it) and lets interpreter exit complete the rest before
# mpi4py finalizes MPI (atexit runs handlers last-registered first).
_pending = weakref.WeakSet()
_orphaned = []  # buffers of requests whose communicator was freed before they completed


@cython.no_gc_clear  # __dealloc__ needs `job` and `keep` even when the request was in a cycle
cdef class Request:
    """A started non-blocking all-reduce: wait() returns its result, test() never blocks.

    The request keeps every tensor it uses alive until it completes. One that is
    dropped without wait() is completed when it is garbage-collected, or at
    interpreter exit; waiting twice returns the same result.
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
    cdef object __weakref__

    def __cinit__(self):
        self.handles = NULL
        self.nhandles = 0
        self.pending = False
        self.staging = NULL
        self.result_data = NULL

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
            with nogil:  # complete it before its buffers go: MPI may still write them
                MPI_Waitall(self.nhandles, self.handles, MPI_STATUSES_IGNORE)
            if self.staging != NULL or self.writeback is not None:
                self._deliver_quietly()  # deliver the result, as wait() would
        free(self.handles)

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
        if self.comm is not None and (<MPI.Comm>self.comm).ob_mpi == MPI_COMM_NULL:
            raise ValueError(
                "fastreduce: the request's communicator was freed before the request "
                "completed; wait for requests before freeing their communicator (this "
                "request can no longer be completed: its tensors are kept alive so that "
                "nothing is overwritten, and its result is not available)")
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
        try:
            _owner = acquire(self.result, &now, False, "the result")
            moved = now.data != self.result_data
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
        cdef size_t nbytes = self.count * self.red.itemsize
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
        """Block until the reduction is done (GIL released) and return the result tensor."""
        cdef int ierr
        if self.flight is not None and self.pending:
            from ..watchdog import waiting
            waiting(self.flight)
        if self.pending and self.job is not None:
            wait_for(self.job)
            if self.pending:  # (another thread may have finished it meanwhile)
                self._finish_job()
        elif self.pending:
            self._check_comm()
            with nogil:
                ierr = MPI_Waitall(self.nhandles, self.handles, MPI_STATUSES_IGNORE)
            self._finish(ierr)
        return self.result

    def test(self) -> bool:
        """Whether the reduction is done (advancing it); never blocks."""
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
        ierr = MPI_Testall(self.nhandles, self.handles, &flag, MPI_STATUSES_IGNORE)
        if ierr != MPI_SUCCESS or flag:
            self._finish(ierr)
            return True
        return False

    def add_done_callback(self, fn) -> None:
        """Call fn(request) once the reduction is done: at once if it is; for a request of
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
        """True once wait() or test() has seen the reduction complete."""
        return not self.pending


cdef Request _start(const void* sendbuf, char* recvbuf, int64_t count, const Reduction* red,
                    MPI_Comm handle, object comm, object result, object keep):
    """MPI_Iallreduce (large-count, or chunked past the int limit) wrapped in a Request."""
    cdef Request req = Request.__new__(Request)
    cdef int64_t limit = count_limit()
    cdef int64_t chunks = 1
    if count > limit and not (FASTREDUCE_HAVE_LARGE_COUNT and red.predefined):
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


def iallreduce_(x, op="sum", *, comm=None):
    """Start reducing x in place over comm; returns a Request whose wait() returns x."""
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    owner = _prepare(x, op, comm, True, &view, &handle, &red)
    if _debug:
        _debug_check(comm, "iallreduce_", &view, op)
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
    if host_enabled(view.count * red.itemsize):
        return _engine_host_start(MPI_IN_PLACE, view.data, view.count, red, comm, x, keep)
    return _start(MPI_IN_PLACE, view.data, view.count, red, handle,
                  default_comm() if comm is None else comm, x, keep)


def iallreduce(x, op="sum", *, comm=None, out=None):
    """Start reducing x over comm into a new tensor (or `out`); returns a Request; x is kept."""
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    owner = _prepare(x, op, comm, False, &view, &handle, &red)
    out_owner = None
    given = out is not None
    if given:
        out_owner = _prepare_out(out, &view, &result)
    else:
        out = new_like(x, &view, &result)
    cdef const void* sendbuf = _send_buffer(&view, &result, red)
    if _debug:
        _debug_check(comm, "iallreduce", &view, op)
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
    if host_enabled(view.count * red.itemsize):
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


# --- the progress engine's staged requests --------------------------------------------

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


def _free_duplicate(comm, keyval, dup) -> None:
    """The communicator is being freed: free the engine's duplicate after its queued jobs."""
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
        _dup_keyval = _MPI.Comm.Create_keyval(delete_fn=_free_duplicate)
    dup = comm.Get_attr(_dup_keyval)
    if dup is None:
        with _setup_recorded("MPI_Comm_dup: the progress engine's", comm):
            dup = comm.Dup()
        dup.Set_errhandler(_MPI.ERRORS_RETURN)
        comm.Set_attr(_dup_keyval, dup)
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
    """At interpreter exit, before MPI is finalized: complete every request still in flight."""
    for req in list(_pending):
        try:
            req.wait()
        except Exception:  # noqa: BLE001  (exit must go on; the error was the user's)
            pass


atexit.register(_complete_pending_requests)


# --- coalesced ----------------------------------------------------------------------

# One flat staging buffer per element kind, kept and grown across calls.
cdef char* _flat[NKINDS]
cdef size_t _flat_capacity[NKINDS]
cdef bint _flat_busy[NKINDS]


cdef char* _flat_buffer(int kind, size_t nbytes, bint* borrowed) except NULL:
    """The reusable staging buffer of `kind` (grown to nbytes), or a private one if in use."""
    cdef char* grown
    if _flat_busy[kind]:  # another thread is inside a coalesced call
        borrowed[0] = False
        grown = <char*>malloc(max(nbytes, 1))
        if grown == NULL:
            raise MemoryError(f"fastreduce: cannot allocate a {nbytes}-byte flat buffer")
        return grown
    if _flat_capacity[kind] < nbytes or _flat[kind] == NULL:
        grown = <char*>malloc(max(nbytes, 1))
        if grown == NULL:
            raise MemoryError(f"fastreduce: cannot allocate a {nbytes}-byte flat buffer")
        free(_flat[kind])
        _flat[kind] = grown
        _flat_capacity[kind] = max(nbytes, 1)
    _flat_busy[kind] = True
    borrowed[0] = True
    return _flat[kind]


def allreduce_coalesced_(tensors, op="sum", *, comm=None):
    """Reduce many tensors in place with one MPI call per dtype, through a reused flat buffer.

    All tensors must be on one device; zero-element tensors are allowed. Returns the list.
    """
    tensors = list(tensors)
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int code = op_code(op)
    _resolve_comm(comm, &handle)
    cdef int n = len(tensors)
    if n == 0:
        return tensors
    cdef BufferView* views = <BufferView*>malloc(n * sizeof(BufferView))
    if views == NULL:
        raise MemoryError("fastreduce: out of memory")
    cdef int i, k
    cdef int64_t counts[NKINDS]
    cdef const Reduction* reds[NKINDS]
    cdef char* flat
    cdef bint borrowed = False
    cdef bint ok = False
    cdef int64_t offset
    cdef size_t nbytes
    owners = []
    entry = None  # the flight record's, while a timeout is set
    try:
        for k in range(NKINDS):
            counts[k] = 0
            reds[k] = NULL
        for i in range(n):  # validate everything before any MPI call
            try:
                owners.append(acquire(tensors[i], &views[i], True, "tensor"))
            except (TypeError, ValueError, BufferError) as exc:
                raise type(exc)(str(exc).replace("fastreduce: tensor", f"fastreduce: tensors[{i}]",
                                                 1)) from None
            if (views[i].device_type != views[0].device_type
                    or views[i].device_id != views[0].device_id):
                raise ValueError(
                    f"fastreduce: tensors[{i}] is on "
                    f"{device_name(views[i].device_type, views[i].device_id)} but tensors[0] "
                    f"on {device_name(views[0].device_type, views[0].device_id)}; a coalesced "
                    f"call takes tensors of one device")
            if reds[views[i].kind] == NULL:
                reds[views[i].kind] = get_reduction(views[i].kind, code)
            counts[views[i].kind] += views[i].count
        _refuse_overlaps(views, n)
        if _debug:
            from .reductions import KIND_NAMES
            from ..checks import fingerprint

            fingerprint(default_comm() if comm is None else comm, "allreduce_coalesced_",
                        counts={KIND_NAMES[k]: counts[k] for k in range(NKINDS)
                                if reds[k] != NULL},
                        op=_op_label(op),
                        device=device_name(views[0].device_type, 0).split(":")[0])
        if _recording:
            from .reductions import KIND_NAMES
            from ..watchdog import begin

            entry = begin("allreduce_coalesced_", comm, sum([counts[k] for k in range(NKINDS)]),
                          "+".join([KIND_NAMES[k] for k in range(NKINDS) if reds[k] != NULL]))
        if views[0].on_device:
            for i in range(n):
                if i == 0 or views[i].stream != views[0].stream:
                    check_not_capturing(<cudaStream_t>views[i].stream, f"tensors[{i}]")
            for i in range(1, n):  # the copies go on tensors[0]'s stream
                if views[i].stream != views[0].stream:
                    with nogil:
                        stream_sync(<cudaStream_t>views[i].stream)
            if views[0].device_type == kDLCUDA:
                _coalesced_device(views, n, counts, reds, handle, comm)
                for i in range(n):
                    if views[i].lazy:
                        _write_back(owners[i])
                ok = True
                return tensors
            with nogil:  # managed memory: the host path, once the producer is done
                stream_sync(<cudaStream_t>views[0].stream)
        for k in range(NKINDS):  # kinds in a fixed order: the same MPI calls on every rank
            if reds[k] == NULL:
                continue
            nbytes = counts[k] * reds[k].itemsize
            flat = _flat_buffer(k, nbytes, &borrowed)
            try:
                with nogil:
                    offset = 0
                    for i in range(n):
                        if views[i].kind == k and views[i].count:
                            memcpy(flat + offset, views[i].data,
                                   views[i].count * reds[k].itemsize)
                            offset += views[i].count * reds[k].itemsize
                _run(MPI_IN_PLACE, flat, counts[k], reds[k], handle)
                with nogil:
                    offset = 0
                    for i in range(n):
                        if views[i].kind == k and views[i].count:
                            memcpy(views[i].data, flat + offset,
                                   views[i].count * reds[k].itemsize)
                            offset += views[i].count * reds[k].itemsize
            finally:
                if borrowed:
                    _flat_busy[k] = False
                else:
                    free(flat)
        for i in range(n):
            if views[i].lazy:
                _write_back(owners[i])
        ok = True
    finally:
        free(views)
        _flight_end(entry, ok)
    return tensors


cdef int _refuse_overlaps(BufferView* views, int n) except -1:
    """ValueError when two of a coalesced call's tensors share memory (each would be
    reduced into the other's result)."""
    spans = sorted([(<size_t>views[i].data, views[i].count * (views[i].dtype.bits // 8), i)
                    for i in range(n) if views[i].count])
    for (start, nbytes, i), (next_start, _, j) in zip(spans, spans[1:]):
        if next_start < start + nbytes:
            first, second = min(i, j), max(i, j)
            raise ValueError(f"fastreduce: tensors[{first}] and tensors[{second}] share "
                             f"memory (the same tensor twice, or overlapping views); pass "
                             f"each memory once")
    return 0


cdef int _coalesced_device(BufferView* views, int n, int64_t* counts, const Reduction** reds,
                           MPI_Comm handle, object comm) except -1:
    """The coalesced call on CUDA memory: per dtype, direct calls (no copies: one MPI call
    per tensor) or one MPI call on a pinned flat buffer; the path is chosen (as one call)
    for the dtype's total bytes."""
    cdef cudaStream_t stream = <cudaStream_t>views[0].stream
    cdef bint synced = False
    cdef Staging* ctx
    cdef int i, k
    cdef int64_t offset
    cdef size_t itemsize
    for k in range(NKINDS):  # kinds in a fixed order: the same MPI calls on every rank
        if reds[k] == NULL:
            continue
        itemsize = reds[k].itemsize
        if choose_path(comm, handle, counts[k] * itemsize, False, reds[k], k) == PATH_DIRECT:
            if not synced:
                with nogil:
                    stream_sync(stream)
                synced = True
            for i in range(n):
                if views[i].kind == k and views[i].count:
                    _run(MPI_IN_PLACE, views[i].data, views[i].count, reds[k], handle)
            continue
        ctx = staging_take(views[0].device_id, counts[k] * itemsize)
        try:
            with nogil:
                staging_order(ctx, stream)
                offset = 0
                for i in range(n):
                    if views[i].kind == k and views[i].count:
                        copy_async(ctx.host + offset, views[i].data, views[i].count * itemsize,
                                   MEMCPY_D2H, stream)
                        offset += views[i].count * itemsize
                stream_sync(stream)
            _run(MPI_IN_PLACE, ctx.host, counts[k], reds[k], handle)
            with nogil:
                offset = 0
                for i in range(n):
                    if views[i].kind == k and views[i].count:
                        copy_async(views[i].data, ctx.host + offset, views[i].count * itemsize,
                                   MEMCPY_H2D, stream)
                        offset += views[i].count * itemsize
                staging_release(ctx, stream)
                if views[0].own_stream:
                    event_sync(ctx.done)
        except BaseException:
            _drain(ctx, stream)
            raise
        finally:
            staging_give(ctx)
    return 0


def _reduce_local(inbuf, inoutbuf, op="sum"):
    """MPI_Reduce_local(inbuf, inoutbuf) with fastreduce's datatype and op; for tests."""
    cdef BufferView a, b
    _owner_a = acquire(inbuf, &a, False, "inbuf")
    _owner_b = acquire(inoutbuf, &b, True, "inoutbuf")
    check_same_layout(&a, &b)
    if a.on_device:
        raise TypeError("_reduce_local takes host memory")
    cdef const Reduction* red = get_reduction(a.kind, op_code(op))
    CHKERR(MPI_Reduce_local(a.data, b.data, <int>a.count, red.datatype, red.op))
    return inoutbuf


def engine_comm(comm=None):
    """The progress engine's duplicate of comm (collective over comm at its first use)."""
    return _engine_comm(comm)


def mpi_reduction(x, op="sum") -> tuple:
    """(MPI datatype, MPI op) that reduce x's elements with `op` as allreduce does (MPI's
    own, or fastreduce's for 16-bit floats); "avg" reduces with "sum" (divide afterwards).
    For the torch.distributed backend's MPI_Reduce and MPI_Reduce_scatter_block."""
    cdef BufferView view
    cdef int code = op_code(op)
    _owner = acquire(x, &view, False, "x")
    cdef const Reduction* red = get_reduction(view.kind, OP_SUM if code == OP_AVG else code)
    cdef MPI.Datatype datatype = MPI.Datatype.__new__(MPI.Datatype)
    cdef MPI.Op mpi_op = MPI.Op.__new__(MPI.Op)
    datatype.ob_mpi = red.datatype  # borrowed: not freed by mpi4py (flags say not owned)
    mpi_op.ob_mpi = red.op
    return datatype, mpi_op


HAVE_LARGE_COUNT = bool(FASTREDUCE_HAVE_LARGE_COUNT)
