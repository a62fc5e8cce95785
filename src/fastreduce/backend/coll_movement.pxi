# Data movement on DLPack tensors (included by collectives.pyx): broadcast, reduce,
# all-gather (equal and uneven), reduce-scatter (block and uneven), all-to-all (equal and
# uneven), gather, scatter, send and recv.
#
# One description of a call (Move), one function that makes its MPI call (_issue), one
# runner for every kind of memory (_run_move: host; CUDA managed; CUDA device memory with
# the device pointers handed to MPI, or staged through pinned host memory). Every check is
# made before any MPI call; the GIL is released while MPI works; debug mode and the flight
# record see each call as they see allreduce's.

from libc.string cimport memset

cdef enum MoveKind:
    MOVE_BCAST
    MOVE_REDUCE
    MOVE_ALLGATHER
    MOVE_ALLGATHERV
    MOVE_REDUCE_SCATTER_BLOCK
    MOVE_REDUCE_SCATTER
    MOVE_ALLTOALL
    MOVE_ALLTOALLV
    MOVE_GATHER
    MOVE_SCATTER
    MOVE_SEND
    MOVE_RECV

ctypedef struct Move:
    int kind
    MPI_Comm comm
    MPI_Datatype unit      # MPI_BYTE, one element as a contiguous type, or the reduction's
    int64_t unit_bytes
    MPI_Op op              # reduce, reduce-scatter
    int root               # the root; for send and recv the peer
    int tag
    int64_t count          # units: the send count of this rank (bcast, reduce: all of it)
    int* recv_counts       # per rank, in units (uneven calls; owned, freed by _free_move)
    int* recv_displs
    int* send_counts
    int* send_displs
    bint in_place          # this rank's send buffer is MPI_IN_PLACE
    bint reads_recv_first  # its receive buffer holds input (in place): staged in as well
    bint writes_recv       # its receive buffer is written
    int64_t send_bytes     # read from the send buffer on this rank
    int64_t recv_bytes     # the receive buffer's extent on this rank
    int divide_kind        # avg: divide the received elements by the size; else -1
    int64_t divide_count
    MPI_Status status      # recv's


cdef MPI_Datatype _element_types[65]  # one element of n bytes as a committed contiguous type
cdef bint _element_made[65]


cdef int _element_type(int64_t itemsize, MPI_Datatype* out) except -1:
    """A committed contiguous datatype of itemsize bytes (made once per size)."""
    if itemsize < 1 or itemsize > 64:
        raise ValueError(f"fastreduce: elements of {itemsize} bytes are not supported")
    if not _element_made[itemsize]:
        CHKERR(MPI_Type_contiguous(<int>itemsize, MPI_BYTE, &_element_types[itemsize]))
        CHKERR(MPI_Type_commit(&_element_types[itemsize]))
        _element_made[itemsize] = True
    out[0] = _element_types[itemsize]
    return 0


cdef int _set_unit(Move* m, int64_t itemsize, int64_t largest_bytes, str call) except -1:
    """Bytes as MPI_BYTE while every count and displacement fits an int; else elements."""
    cdef int64_t limit = count_limit()
    if largest_bytes <= limit:
        m.unit, m.unit_bytes = MPI_BYTE, 1
        return 0
    if largest_bytes // itemsize <= limit:
        _element_type(itemsize, &m.unit)
        m.unit_bytes = itemsize
        return 0
    raise OverflowError(f"fastreduce: {call} of {largest_bytes // itemsize} elements per rank "
                        f"is past what one MPI call takes here ({limit}); split the tensor "
                        f"into parts and call once per part")


cdef int _agreed_unit(Move* m, int64_t itemsize, int64_t largest_bytes, MPI_Comm handle,
                      object comm, str call) except -1:
    """_set_unit for a call whose counts differ between ranks (uneven all-to-all): the
    ranks first learn whether any is past what one MPI call takes (one 4-byte
    MPI_Allreduce), so that all refuse together instead of some waiting for ever."""
    cdef int32_t past = largest_bytes // itemsize > count_limit()
    cdef int ierr
    with _setup_recorded(f"{call}: whether a rank's part is too large (MPI_Allreduce)",
                         default_comm() if comm is None else comm):
        with nogil:
            ierr = MPI_Allreduce(MPI_IN_PLACE, &past, 1, MPI_INT32_T, MPI_MAX, handle)
        CHKERR(ierr)
    if past and largest_bytes // itemsize <= count_limit():
        raise OverflowError(f"fastreduce: {call}: another rank's part is past what one MPI "
                            f"call takes here ({count_limit()} elements); split the tensor "
                            f"into parts and call once per part")
    return _set_unit(m, itemsize, largest_bytes, call)


cdef inline int64_t _itemsize(BufferView* v) noexcept:
    return (v.dtype.bits * v.dtype.lanes + 7) // 8


cdef void _free_move(Move* m) noexcept:
    free(m.recv_counts)
    free(m.recv_displs)
    free(m.send_counts)
    free(m.send_displs)
    m.recv_counts = m.recv_displs = m.send_counts = m.send_displs = NULL


cdef int* _int_array(int n) except NULL:
    cdef int* a = <int*>malloc(max(n, 1) * sizeof(int))
    if a == NULL:
        raise MemoryError("fastreduce: out of memory for the counts of a call")
    return a


cdef int _issue(Move* m, const void* send, void* recv) noexcept nogil:
    """The call's MPI call on these buffers (host or device); broadcast and reduce in
    int-sized pieces past the int limit."""
    cdef int64_t limit = count_limit()
    cdef int64_t done = 0
    cdef int64_t n
    cdef int ierr = MPI_SUCCESS
    cdef int c = <int>m.count
    cdef MPI_Message message = MPI_MESSAGE_NULL
    if m.kind == MOVE_BCAST or m.kind == MOVE_REDUCE:
        while ierr == MPI_SUCCESS and (done < m.count or done == 0):
            n = min(limit, m.count - done)
            if m.kind == MOVE_BCAST:
                ierr = MPI_Bcast(<char*>recv + done * m.unit_bytes, <int>n, m.unit, m.root,
                                 m.comm)
            else:
                ierr = MPI_Reduce(
                    send if send == MPI_IN_PLACE or send == NULL
                    else <const char*>send + done * m.unit_bytes,
                    NULL if recv == NULL else <char*>recv + done * m.unit_bytes,
                    <int>n, m.unit, m.op, m.root, m.comm)
            done += n
            if m.count == 0:
                break
        return ierr
    if m.kind == MOVE_ALLGATHER:
        return MPI_Allgather(send, c, m.unit, recv, c, m.unit, m.comm)
    if m.kind == MOVE_ALLGATHERV:
        return MPI_Allgatherv(send, c, m.unit, recv, m.recv_counts, m.recv_displs, m.unit,
                              m.comm)
    if m.kind == MOVE_REDUCE_SCATTER_BLOCK:
        return MPI_Reduce_scatter_block(send, recv, c, m.unit, m.op, m.comm)
    if m.kind == MOVE_REDUCE_SCATTER:
        return MPI_Reduce_scatter(send, recv, m.recv_counts, m.unit, m.op, m.comm)
    if m.kind == MOVE_ALLTOALL:
        return MPI_Alltoall(send, c, m.unit, recv, c, m.unit, m.comm)
    if m.kind == MOVE_ALLTOALLV:
        return MPI_Alltoallv(send, m.send_counts, m.send_displs, m.unit, recv, m.recv_counts,
                             m.recv_displs, m.unit, m.comm)
    if m.kind == MOVE_GATHER:
        return MPI_Gather(send, c, m.unit, recv, c, m.unit, m.root, m.comm)
    if m.kind == MOVE_SCATTER:
        return MPI_Scatter(send, c, m.unit, recv, c, m.unit, m.root, m.comm)
    if m.kind == MOVE_SEND:
        return MPI_Send(send, c, m.unit, m.root, m.tag, m.comm)
    if m.kind == MOVE_RECV and m.root == MPI_ANY_SOURCE:
        # a matched probe: MPICH 5.0 with UCX over TCP leaves a posted any-source receive
        # unmatched across nodes; a matched probe and a named receive are not affected
        ierr = MPI_Mprobe(MPI_ANY_SOURCE, m.tag, m.comm, &message, &m.status)
        if ierr == MPI_SUCCESS:
            ierr = MPI_Mrecv(recv, c, m.unit, &message, &m.status)
        return ierr
    if m.kind == MOVE_RECV:
        return MPI_Recv(recv, c, m.unit, m.root, m.tag, m.comm, &m.status)
    return MPI_ERR_OTHER


cdef int _divide(Move* m, char* recv) except -1:
    """avg: the received elements divided by the communicator's size."""
    cdef int size = 1
    if m.divide_kind < 0 or m.divide_count == 0 or recv == NULL:
        return 0
    CHKERR(MPI_Comm_size(m.comm, &size))
    with nogil:
        fr_divide(recv, m.divide_count, m.divide_kind, size)
    return 0


cdef inline int _issue_on(Move* m, const void* send, void* recv) noexcept nogil:
    """_issue with MPI_IN_PLACE where this rank's call is in place: the send buffer's place,
    except for scatter, whose root names its receive buffer so."""
    if not m.in_place:
        return _issue(m, send, recv)
    if m.kind == MOVE_SCATTER:
        return _issue(m, send, MPI_IN_PLACE)
    return _issue(m, MPI_IN_PLACE, recv)


cdef int _move_host(Move* m, const char* send, char* recv) except -1:
    cdef int ierr
    with nogil:
        ierr = _issue_on(m, send, recv)
    CHKERR(ierr)
    return _divide(m, recv)


cdef int _move_staged(Move* m, BufferView* dev, const char* send, char* recv) except -1:
    """Through pinned host memory: what this rank sends (and a receive buffer that holds
    input) copied in on the producer's stream, MPI on the host, what it receives copied
    back on that stream; the caller's later work on the stream is ordered after it. Large
    calls of equal blocks go in pipelined chunks (_move_pipelined)."""
    cdef Pieces pieces
    if _plan_pieces(m, &pieces):
        return _move_pipelined(m, dev, send, recv, &pieces)
    cdef cudaStream_t stream = <cudaStream_t>dev.stream
    cdef int64_t send_bytes = 0 if m.in_place and m.kind != MOVE_SCATTER else m.send_bytes
    cdef Staging* ctx = staging_take(dev.device_id, max(send_bytes + m.recv_bytes, 1))
    cdef char* hsend = ctx.host
    cdef char* hrecv = ctx.host + send_bytes
    cdef int ierr
    try:
        with nogil:
            staging_order(ctx, stream)  # the pinned memory's last reader has finished
            if send_bytes:
                copy_async(hsend, send, send_bytes, MEMCPY_D2H, stream)
            if m.reads_recv_first and m.recv_bytes:
                copy_async(hrecv, recv, m.recv_bytes, MEMCPY_D2H, stream)
            stream_sync(stream)
            ierr = _issue_on(m, hsend, hrecv if recv != NULL else NULL)
        CHKERR(ierr)
        _divide(m, hrecv if recv != NULL else NULL)
        with nogil:
            if m.writes_recv and m.recv_bytes:
                copy_async(recv, hrecv, m.recv_bytes, MEMCPY_H2D, stream)
            staging_release(ctx, stream)
            if dev.own_stream:
                event_sync(ctx.done)
    except BaseException:
        _drain(ctx, stream)
        raise
    finally:
        staging_give(ctx)
    return 0


# --- staged in pipelined chunks ------------------------------------------------------------
#
# A call whose ranks move blocks of one size (broadcast, reduce, all-gather, gather, scatter,
# reduce-scatter, all-to-all) is, chunk by chunk, the same call on bytes [k * piece,
# (k + 1) * piece) of every block. Each chunk's blocks are packed in a slot of pinned memory,
# so MPI sees the plain call with a smaller count (no derived datatypes; fastreduce's own ops
# work as they are). While MPI moves chunk i, later chunks are copied in on one stream of
# the staging context and earlier ones out on the other, through STAGING_SLOTS slots, as
# in the staged all-reduce. Every rank cuts alike: the block, the number of blocks and the
# chunk setting are the same on each. The uneven calls, and send and recv (whose peer may
# be on host memory, in one message), are staged whole.

ctypedef struct Pieces:
    int64_t block         # bytes of one rank's block
    int64_t piece         # bytes of each block in one chunk (the last chunk's may be fewer)
    int64_t nchunks
    int send_blocks       # blocks this rank sends: copied in, packed, chunk by chunk
    int recv_blocks       # blocks the host call receives
    int back_blocks       # of those, copied back to the device (0 or recv_blocks)
    bint reduces          # counts in the reduction's elements (else in bytes)


cdef int _plan_pieces(Move* m, Pieces* p) except -1:
    """1 and p filled where m is staged in pipelined chunks; 0 where it is staged whole
    (another kind of call, or one chunk would hold it: gpupaths.plan_staging's rule for
    the call on the bytes of every block together)."""
    cdef int rank = 0, size = 1, blocks
    cdef int64_t chunk, align
    if m.kind not in (MOVE_BCAST, MOVE_REDUCE, MOVE_ALLGATHER, MOVE_GATHER, MOVE_SCATTER,
                      MOVE_REDUCE_SCATTER_BLOCK, MOVE_ALLTOALL):
        return 0
    _rank_size(m.comm, &rank, &size)
    cdef bint root = rank == m.root
    p.block = m.count * m.unit_bytes
    p.reduces = m.kind == MOVE_REDUCE or m.kind == MOVE_REDUCE_SCATTER_BLOCK
    blocks = 1 if m.kind == MOVE_BCAST or m.kind == MOVE_REDUCE else size
    if p.block == 0:
        return 0
    chunk = movement_chunk_bytes(p.block * blocks, p.reduces or m.kind == MOVE_SCATTER)
    if chunk >= p.block * blocks:
        return 0
    align = 16 if not p.reduces or 16 % m.unit_bytes == 0 else m.unit_bytes
    p.piece = max(align, chunk // blocks // align * align)
    if p.piece >= p.block:
        return 0
    p.nchunks = (p.block + p.piece - 1) // p.piece
    if m.kind == MOVE_BCAST:
        p.send_blocks, p.recv_blocks = root, not root
    elif m.kind == MOVE_REDUCE:
        p.send_blocks, p.recv_blocks = 1, root
    elif m.kind == MOVE_ALLGATHER:
        p.send_blocks, p.recv_blocks = 1, size
    elif m.kind == MOVE_GATHER:
        p.send_blocks, p.recv_blocks = 1, size if root else 0
    elif m.kind == MOVE_SCATTER:
        p.send_blocks, p.recv_blocks = size if root else 0, 1
    elif m.kind == MOVE_REDUCE_SCATTER_BLOCK:
        p.send_blocks, p.recv_blocks = size, 1
    else:  # all-to-all
        p.send_blocks, p.recv_blocks = size, size
    p.back_blocks = p.recv_blocks if m.writes_recv else 0
    return 1


cdef int _stage_blocks_in(Staging* ctx, Pieces* p, const char* src, int64_t slot_bytes,
                          int64_t j) except -1 nogil:
    """Queue chunk j of each block this rank sends to its slot (packed) on the context's
    device-to-host stream, then mark the slot ready (also where nothing is copied)."""
    cdef int slot = j % STAGING_SLOTS
    cdef int64_t n = min(p.piece, p.block - j * p.piece)
    cdef char* host = ctx.host + slot * slot_bytes
    cdef int q
    for q in range(p.send_blocks):
        copy_async(host + q * n, src + q * p.block + j * p.piece, n, MEMCPY_D2H,
                   ctx.d2h_stream)
    return event_record(ctx.d2h[slot], ctx.d2h_stream)


cdef int _move_pipelined(Move* m, BufferView* dev, const char* send, char* recv,
                         Pieces* p) except -1:
    """m staged in p's chunks: each chunk's MPI call on its slot of pinned memory, out of
    place (an in-place call's input is read from where it lies on the device), its results
    copied to their places in recv; later work on the producer's stream ordered after the
    last copy out."""
    cdef cudaStream_t stream = <cudaStream_t>dev.stream
    cdef const char* src = send if send != NULL else recv  # a broadcast's root sends recv
    cdef int64_t slot_bytes = (p.send_blocks + p.recv_blocks) * p.piece
    cdef int64_t nslots = min(<int64_t>STAGING_SLOTS, p.nchunks)
    cdef Staging* ctx = staging_take(dev.device_id, max(nslots * slot_bytes, 1))
    cdef Move c = m[0]  # each chunk's call (m's count arrays are NULL for these kinds)
    cdef int64_t i, j, n
    cdef int slot, q, ierr
    cdef char* hsend
    cdef char* hrecv
    c.in_place = False
    if not p.reduces:
        c.unit, c.unit_bytes = MPI_BYTE, 1
    try:
        with nogil:
            event_record(ctx.start, stream)  # after the producer's work so far
            stream_wait_event(ctx.d2h_stream, ctx.start)
            staging_order(ctx, ctx.d2h_stream)  # the slots' last reader has finished
            stream_wait_event(ctx.h2d_stream, ctx.start)
            for j in range(nslots):
                _stage_blocks_in(ctx, p, src, slot_bytes, j)
        for i in range(p.nchunks):
            slot = i % STAGING_SLOTS
            n = min(p.piece, p.block - i * p.piece)
            hsend = ctx.host + slot * slot_bytes
            hrecv = hsend + p.send_blocks * n
            c.count = n // c.unit_bytes
            c.divide_count = n // m.unit_bytes
            with nogil:
                event_sync(ctx.d2h[slot])  # chunk i is in; the slot's last copy out is done
                ierr = _issue(&c, hsend if p.send_blocks else NULL,
                              hrecv if p.recv_blocks else (hsend if m.kind == MOVE_BCAST
                                                           else NULL))
            CHKERR(ierr)
            if p.recv_blocks:
                _divide(&c, hrecv)
            with nogil:
                for q in range(p.back_blocks):
                    copy_async(recv + q * p.block + i * p.piece, hrecv + q * n, n, MEMCPY_H2D,
                               ctx.h2d_stream)
                event_record(ctx.h2d[slot], ctx.h2d_stream)
                j = i + STAGING_SLOTS
                if j < p.nchunks:  # refill the slot once its copies out are done
                    stream_wait_event(ctx.d2h_stream, ctx.h2d[slot])
                    _stage_blocks_in(ctx, p, src, slot_bytes, j)
        with nogil:
            staging_release(ctx, ctx.h2d_stream)
            _pipeline_end(ctx, stream, dev.own_stream)
    except BaseException:
        _drain(ctx, stream)
        raise
    finally:
        staging_give(ctx)
    return 0


cdef int _run_move(Move* m, BufferView* dev, const char* send, char* recv, object comm,
                   str call, int64_t count, int kind, const Reduction* red) except -1:
    """m's MPI call on host memory, or on the CUDA memory of `dev` (managed; device
    pointers where the MPI takes them and the path choice says so; else staged), in the
    flight record while a timeout is set."""
    cdef int64_t entry = _flight_blocking(comm, call, count, kind)
    cdef int path
    try:
        if not dev.on_device:
            _move_host(m, send, recv)
        else:
            _check_capture(dev, dev)
            if dev.device_type == kDLCUDAManaged:
                with nogil:
                    stream_sync(<cudaStream_t>dev.stream)
                _move_host(m, send, recv)
            else:
                path = _movement_path(m, comm, dev, red)
                if path == PATH_DIRECT:
                    with nogil:
                        stream_sync(<cudaStream_t>dev.stream)
                    _move_host(m, send, recv)
                else:
                    _move_staged(m, dev, send, recv)
    except BaseException:
        _flight_done(entry, False)
        raise
    _flight_done(entry, True)
    return 0


cdef int _movement_path(Move* m, object comm, BufferView* dev, const Reduction* red) except -1:
    """The GPU path. Collectives ask pathchoice (whose first call on a communicator is an
    agreement of its ranks); send and recv, which the other ranks do not join, take the
    staged path unless that agreement exists already and allows direct."""
    cdef int64_t nbytes = max(m.send_bytes, m.recv_bytes)
    return choose_movement_path(comm, m.comm, nbytes, False, dev.kind, red,
                                m.kind != MOVE_SEND and m.kind != MOVE_RECV)


# --- the checks every call makes before any MPI call -------------------------------------

cdef int _rank_size(MPI_Comm handle, int* rank, int* size) except -1:
    CHKERR(MPI_Comm_rank(handle, rank))
    CHKERR(MPI_Comm_size(handle, size))
    return 0


cdef int _check_rank(object value, int size, str what, str call) except -1:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"fastreduce: {call}: {what} must be an int rank, not "
                        f"{type(value).__qualname__}")
    if not 0 <= value < size:
        raise ValueError(f"fastreduce: {call}: {what} {value} is not a rank of the "
                         f"communicator (0..{size - 1})")
    return 0


cdef int _check_out(BufferView* x, BufferView* out, int64_t count, str call) except -1:
    """out holds `count` elements of x's dtype on x's device."""
    if out.kind != x.kind:
        raise ValueError(f"fastreduce: {call}: out is {_KIND_NAMES[out.kind]}, the input "
                         f"{_KIND_NAMES[x.kind]}; give an out of the input's dtype")
    if out.device_type != x.device_type or out.device_id != x.device_id:
        raise ValueError(f"fastreduce: {call}: out is on "
                         f"{device_name(out.device_type, out.device_id)}, the input on "
                         f"{device_name(x.device_type, x.device_id)}; give an out on the "
                         f"input's device")
    if out.count != count:
        raise ValueError(f"fastreduce: {call}: out has {out.count} elements; it needs "
                         f"{count}")
    return 0


cdef int _check_apart(BufferView* x, BufferView* out, str call) except -1:
    """ValueError where x and out share memory (a call that has no in-place form)."""
    cdef int64_t a = x.count * _itemsize(x)
    cdef int64_t b = out.count * _itemsize(out)
    if a and b and x.data < out.data + b and out.data < x.data + a:
        raise ValueError(f"fastreduce: {call}: out overlaps the input in memory; give an out "
                         f"of its own")
    return 0


cdef int _fill_counts(object counts, int size, int64_t* total, str what,
                      str call) except -1:
    """Per-rank element counts: `size` ints, none negative; their sum into total."""
    try:
        values = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise TypeError(f"fastreduce: {call}: {what} must be a sequence of {size} element "
                        f"counts") from None
    if len(values) != size or any(c < 0 for c in values):
        raise ValueError(f"fastreduce: {call}: {what} {values} must be {size} non-negative "
                         f"element counts, one per rank")
    total[0] = sum(values)
    return 0


cdef int _to_units(Move* m, int* counts, int* displs, object values, int size,
                   int64_t itemsize) except -1:
    """Element counts as counts and displacements in the call's unit."""
    cdef int64_t offset = 0
    cdef int64_t per = itemsize // m.unit_bytes
    cdef int i
    for i in range(size):
        counts[i] = <int>(<int64_t>values[i] * per)
        displs[i] = <int>(offset * per)
        offset += values[i]
    return 0


cdef object _result_for(object x, BufferView* view, object out, int64_t count,
                        BufferView* result, str call):
    """out acquired for writing (a new tensor like x of `count` elements when None)."""
    if out is None:
        out = _new_elements(x, view, count, call)
    owner = acquire(out, result, True, "out")
    _check_out(view, result, count, call)
    return out, owner


cdef object _new_elements(object x, BufferView* view, int64_t count, str call):
    """A new tensor of x's type, dtype and device with `count` elements: rows of x's
    trailing shape where count is a whole number of them, else flat. Producers with the
    DLPack C exchange API get memory of ours (large host results from the cached block
    pool: no page faults for a result made again and again), others their own."""
    shape = tuple(x.shape) if hasattr(x, "shape") else ()
    row = 1
    for d in shape[1:]:
        row *= d
    new_shape = (count // row,) + shape[1:] if shape and row and count % row == 0 else (count,)
    cdef int64_t dims[64]
    cdef BufferView like, made
    cdef int i
    if (view.api != NULL and view.api.managed_tensor_to_py_object_no_sync != NULL
            and (view.device_type == kDLCPU or view.api.managed_tensor_allocator != NULL)
            and not view.lazy and len(new_shape) <= 64):
        like = view[0]
        for i in range(len(new_shape)):
            dims[i] = new_shape[i]
        like.ndim, like.shape, like.count = len(new_shape), dims, count
        return new_like(x, &like, &made)
    new_empty = getattr(x, "new_empty", None)  # torch
    if new_empty is not None:
        return new_empty(new_shape)
    module = sys.modules.get(type(x).__module__.partition(".")[0])
    empty = getattr(module, "empty", None)
    if empty is None or not hasattr(x, "dtype"):
        raise TypeError(f"fastreduce: {call} cannot allocate a result of type "
                        f"{type(x).__qualname__}; pass out=")
    return empty(new_shape, dtype=x.dtype)


cdef int _debug_move(object comm, str call, BufferView* view, object op, object root,
                     object counts, object pairwise=None) except -1:
    """Debug mode: the ranks agree on the call, its dtype, op, root and counts (None: this
    rank's element count); pairwise: (send counts, receive counts) of an uneven all-to-all,
    which must match between each pair of ranks. Not on the progress engine's thread:
    whoever queued the job checked the call (checks' exchanges are the caller's)."""
    if on_engine_thread():
        return 0
    fields = dict(count=view.count if counts is None else tuple(int(c) for c in counts),
                  dtype=_KIND_NAMES[view.kind], op=None if op is None else _op_label(op),
                  root=root, device=device_name(view.device_type, view.device_id).split(":")[0])
    if pairwise is not None:
        fields["pairwise"] = pairwise
        fields["count"] = None
    _fingerprint_hook(default_comm() if comm is None else comm, call, **fields)
    return 0


# --- now, or on the progress engine -------------------------------------------------------

cdef class _MoveJob(Job):
    """A non-blocking data-movement call on host memory, run by the progress engine on its
    duplicate of the communicator (the call's counts are the job's: freed with it)."""

    cdef Move m
    cdef BufferView dev
    cdef const char* send
    cdef char* recv
    cdef object dup
    cdef object keep
    cdef str call
    cdef int64_t count
    cdef int kind
    cdef const Reduction* red

    def __dealloc__(self):
        _free_move(&self.m)

    cdef int execute(self) except -1:
        self.m.comm = <MPI_Comm>(<MPI.Comm>self.dup).ob_mpi
        return _run_move(&self.m, &self.dev, self.send, self.recv, self.dup, self.call,
                         self.count, self.kind, self.red)

    cdef int cleanup(self) except -1:
        self.keep = None
        _free_move(&self.m)
        return 0


cdef object _finish_move(Move* m, BufferView* dev, const char* send, char* recv, object comm,
                         str call, int64_t count, int kind, const Reduction* red, bint start,
                         object result, object writeback, object keep):
    """Run the call now and return its result (in a Request that is done, when `start`); or,
    started on host memory with the progress engine on (every rank decides alike), queue it
    on the engine and return its Request. GPU memory runs now: its copies keep to the
    caller's stream order. `writeback`: a lazy view's Resolved, written back when done."""
    cdef _MoveJob job
    cdef Request req
    if start and not dev.on_device and enabled():
        job = _MoveJob.__new__(_MoveJob)
        job.m = m[0]
        m.recv_counts = m.recv_displs = m.send_counts = m.send_displs = NULL  # the job's now
        job.dev = dev[0]
        job.send, job.recv, job.red = send, recv, red
        job.dup, job.keep = _engine_comm(comm), keep
        job.call, job.count, job.kind = call, count, kind
        req = Request.__new__(Request)
        req.job, req.result, req.keep, req.pending = job, result, keep, True
        req.writeback = writeback
        _pending.add(req)
        submit(job)
        return req
    _run_move(m, dev, send, recv, comm, call, count, kind, red)
    if writeback is not None:
        _write_back(writeback)
    if not start:
        return result
    req = Request.__new__(Request)
    req.result = result
    return req


# --- the calls --------------------------------------------------------------------------

def broadcast_(x, root=0, *, comm=None):
    """Broadcast x from rank `root` of comm into x on every other rank (MPI_Bcast);
    returns x."""
    return _broadcast(x, root, comm, False)


def ibroadcast_(x, root=0, *, comm=None) -> Request:
    """Start ``broadcast_``; a Request whose wait() returns x."""
    return _broadcast(x, root, comm, True)


cdef object _broadcast(object x, root, comm, bint start):
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int rank = 0, size = 1
    cdef Move m
    _resolve_comm(comm, &handle)
    _rank_size(handle, &rank, &size)
    _check_rank(root, size, "root", "broadcast_")
    _owner = acquire(x, &view, rank != root, "x")
    memset(&m, 0, sizeof(Move))
    m.kind, m.comm, m.root, m.divide_kind = MOVE_BCAST, handle, root, -1
    cdef int64_t nbytes = view.count * _itemsize(&view)
    m.unit, m.unit_bytes, m.count = MPI_BYTE, 1, nbytes  # _issue splits past the int limit
    m.in_place = True
    m.reads_recv_first = rank == root
    m.writes_recv = rank != root
    m.recv_bytes = nbytes
    if _debug:
        _debug_move(comm, "ibroadcast_" if start else "broadcast_", &view, None, root, None)
    _agreed(handle)
    return _finish_move(&m, &view, NULL, view.data, comm, "broadcast_", view.count, view.kind,
                        NULL, start, x, _owner if view.lazy and rank != root else None,
                        (x, _owner))


def reduce_(x, op="sum", root=0, *, comm=None):
    """Reduce x over comm into x on rank `root` (MPI_Reduce, in place there); x is only
    read on the other ranks. Returns x."""
    return _reduce(x, op, root, comm, False)


def ireduce_(x, op="sum", root=0, *, comm=None) -> Request:
    """Start ``reduce_``; a Request whose wait() returns x."""
    return _reduce(x, op, root, comm, True)


cdef object _reduce(object x, op, root, comm, bint start):
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    cdef int rank = 0, size = 1
    cdef Move m
    cdef int code = op_code(op)
    _resolve_comm(comm, &handle)
    _rank_size(handle, &rank, &size)
    _check_rank(root, size, "root", "reduce_")
    _owner = acquire(x, &view, rank == root, "x")
    red = get_reduction(view.kind, code)
    memset(&m, 0, sizeof(Move))
    m.kind, m.comm, m.root = MOVE_REDUCE, handle, root
    m.unit, m.unit_bytes, m.op, m.count = red.datatype, red.itemsize, red.op, view.count
    m.in_place = rank == root
    m.reads_recv_first = rank == root
    m.writes_recv = rank == root
    m.send_bytes = view.count * red.itemsize
    m.recv_bytes = m.send_bytes if rank == root else 0
    m.divide_kind = red.divide_kind if rank == root else -1
    m.divide_count = view.count
    if _debug:
        _debug_move(comm, "ireduce_" if start else "reduce_", &view, op, root, None)
    _agreed(handle)
    return _finish_move(&m, &view, view.data, view.data if rank == root else NULL, comm,
                        "reduce_", view.count, view.kind, red, start, x,
                        _owner if view.lazy and rank == root else None, (x, _owner))


cdef bint _all_equal(object counts):
    """counts (as every rank gives them) are one count repeated: the call of equal parts
    does the same work, and a staged one is pipelined (the v calls are staged whole)."""
    return len({int(c) for c in counts}) == 1


def allgather(x, *, comm=None, out=None, counts=None):
    """Every rank's x, in rank order, into out on every rank (MPI_Allgather; with `counts`,
    each rank's element count, MPI_Allgatherv, or MPI_Allgather where they are equal); x
    may be this rank's part of out (in place). Returns out (new when None)."""
    return _allgather(x, comm, out, counts, False)


def iallgather(x, *, comm=None, out=None, counts=None) -> Request:
    """Start ``allgather``; a Request whose wait() returns out."""
    return _allgather(x, comm, out, counts, True)


cdef object _allgather(object x, comm, out, counts, bint start):
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int rank = 0, size = 1
    cdef Move m
    cdef int64_t total = 0
    cdef int64_t item, before = 0
    cdef int i
    _resolve_comm(comm, &handle)
    _rank_size(handle, &rank, &size)
    _owner = acquire(x, &view, False, "x")
    item = _itemsize(&view)
    if counts is None:
        total = view.count * size
        before = view.count * rank
    else:
        _fill_counts(counts, size, &total, "counts", "allgather")
        if int(counts[rank]) != view.count:
            raise ValueError(f"fastreduce: allgather: counts[{rank}] is {int(counts[rank])}, "
                             f"this rank's x has {view.count} elements; they must match")
        for i in range(rank):
            before += int(counts[i])
    out, out_owner = _result_for(x, &view, out, total, &result, "allgather")
    memset(&m, 0, sizeof(Move))
    m.comm, m.divide_kind = handle, -1
    m.in_place = (view.count > 0 and result.data + before * item == view.data
                  and not view.lazy and not result.lazy)
    if not m.in_place:
        _check_apart(&view, &result, "allgather")
    m.send_bytes = view.count * item
    m.recv_bytes = total * item
    m.reads_recv_first = m.in_place
    m.writes_recv = True
    try:
        if counts is None or _all_equal(counts):  # (one rank's part is what one count holds)
            m.kind = MOVE_ALLGATHER
            _set_unit(&m, item, m.send_bytes, "allgather")
        else:
            m.kind = MOVE_ALLGATHERV
            _set_unit(&m, item, total * item, "allgather")
            m.recv_counts = _int_array(size)
            m.recv_displs = _int_array(size)
            _to_units(&m, m.recv_counts, m.recv_displs, [int(c) for c in counts], size, item)
        m.count = view.count * item // m.unit_bytes
        if _debug:
            _debug_move(comm, "iallgather" if start else "allgather", &view, None, None,
                        counts)
        _agreed(handle)
        return _finish_move(&m, &view, view.data, result.data, comm, "allgather", total,
                            view.kind, NULL, start, out, out_owner if result.lazy else None,
                            (x, _owner, out, out_owner))
    finally:
        _free_move(&m)  # (nothing left to free when a job took the counts)


def reduce_scatter(x, op="sum", *, comm=None, out=None, counts=None):
    """Reduce x over comm and give rank r the r-th part into out (MPI_Reduce_scatter_block:
    equal parts; with `counts`, each rank's element count, MPI_Reduce_scatter, or
    MPI_Reduce_scatter_block where they are equal). Returns out (new when None)."""
    return _reduce_scatter(x, op, comm, out, counts, False)


def ireduce_scatter(x, op="sum", *, comm=None, out=None, counts=None) -> Request:
    """Start ``reduce_scatter``; a Request whose wait() returns out."""
    return _reduce_scatter(x, op, comm, out, counts, True)


cdef object _reduce_scatter(object x, op, comm, out, counts, bint start):
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    cdef int rank = 0, size = 1
    cdef Move m
    cdef int64_t total = 0, mine
    cdef int code = op_code(op)
    _resolve_comm(comm, &handle)
    _rank_size(handle, &rank, &size)
    _owner = acquire(x, &view, False, "x")
    red = get_reduction(view.kind, code)
    if counts is None:
        if view.count % size:
            raise ValueError(f"fastreduce: reduce_scatter: x has {view.count} elements, which "
                             f"do not divide among {size} ranks; give counts= for uneven "
                             f"parts")
        mine = view.count // size
    else:
        _fill_counts(counts, size, &total, "counts", "reduce_scatter")
        if total != view.count:
            raise ValueError(f"fastreduce: reduce_scatter: counts add up to {total}, x has "
                             f"{view.count} elements; they must match")
        mine = int(counts[rank])
    out, out_owner = _result_for(x, &view, out, mine, &result, "reduce_scatter")
    _check_apart(&view, &result, "reduce_scatter")
    memset(&m, 0, sizeof(Move))
    m.comm, m.op, m.unit, m.unit_bytes = handle, red.op, red.datatype, red.itemsize
    m.send_bytes = view.count * red.itemsize
    m.recv_bytes = mine * red.itemsize
    m.writes_recv = True
    m.divide_kind, m.divide_count = red.divide_kind, mine
    cdef int i
    if mine > count_limit() or (counts is not None and max(int(c) for c in counts) > count_limit()):
        raise OverflowError(f"fastreduce: reduce_scatter of more than {count_limit()} "
                            f"elements per rank is past what one MPI call takes here; split "
                            f"the tensor into parts and call once per part")
    try:
        if counts is None or _all_equal(counts):
            m.kind, m.count = MOVE_REDUCE_SCATTER_BLOCK, mine
        else:
            m.kind = MOVE_REDUCE_SCATTER
            m.recv_counts = _int_array(size)
            for i in range(size):
                m.recv_counts[i] = int(counts[i])
        if _debug:
            _debug_move(comm, "ireduce_scatter" if start else "reduce_scatter", &view, op,
                        None, counts)
        _agreed(handle)
        return _finish_move(&m, &view, view.data, result.data, comm, "reduce_scatter",
                            view.count, view.kind, red, start, out,
                            out_owner if result.lazy else None, (x, _owner, out, out_owner))
    finally:
        _free_move(&m)  # (nothing left to free when a job took the counts)


def alltoall(x, *, comm=None, out=None, send_counts=None, recv_counts=None):
    """Part j of x to rank j, part r of out from rank r (MPI_Alltoall: equal parts; with
    send_counts and recv_counts, element counts per rank, MPI_Alltoallv). Returns out (new
    when None)."""
    return _alltoall(x, comm, out, send_counts, recv_counts, False)


def ialltoall(x, *, comm=None, out=None, send_counts=None, recv_counts=None) -> Request:
    """Start ``alltoall``; a Request whose wait() returns out."""
    return _alltoall(x, comm, out, send_counts, recv_counts, True)


cdef object _alltoall(object x, comm, out, send_counts, recv_counts, bint start):
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int rank = 0, size = 1
    cdef Move m
    cdef int64_t sent = 0, received = 0, item
    _resolve_comm(comm, &handle)
    _rank_size(handle, &rank, &size)
    _owner = acquire(x, &view, False, "x")
    item = _itemsize(&view)
    if (send_counts is None) != (recv_counts is None):
        raise ValueError("fastreduce: alltoall: give both send_counts and recv_counts, or "
                         "neither (equal parts)")
    if send_counts is None:
        if view.count % size:
            raise ValueError(f"fastreduce: alltoall: x has {view.count} elements, which do "
                             f"not divide among {size} ranks; give send_counts and "
                             f"recv_counts for uneven parts")
        received = view.count
    else:
        _fill_counts(send_counts, size, &sent, "send_counts", "alltoall")
        _fill_counts(recv_counts, size, &received, "recv_counts", "alltoall")
        if sent != view.count:
            raise ValueError(f"fastreduce: alltoall: send_counts add up to {sent}, x has "
                             f"{view.count} elements; they must match")
    out, out_owner = _result_for(x, &view, out, received, &result, "alltoall")
    _check_apart(&view, &result, "alltoall")
    memset(&m, 0, sizeof(Move))
    m.comm, m.divide_kind = handle, -1
    m.send_bytes = view.count * item
    m.recv_bytes = received * item
    m.writes_recv = True
    if _debug:  # before the count check's exchange below, so that a mismatch is named
        _debug_move(comm, "ialltoall" if start else "alltoall", &view, None, None, None,
                    None if send_counts is None
                    else ([int(c) for c in send_counts], [int(c) for c in recv_counts]))
    _agreed(handle)
    try:
        if send_counts is None:  # one part is what one count must hold
            _set_unit(&m, item, m.send_bytes // size, "alltoall")
        else:
            _agreed_unit(&m, item, max(m.send_bytes, m.recv_bytes), handle, comm,
                         "alltoall")
        if send_counts is None:
            m.kind = MOVE_ALLTOALL
            m.count = view.count // size * item // m.unit_bytes
        else:
            m.kind = MOVE_ALLTOALLV
            m.send_counts, m.send_displs = _int_array(size), _int_array(size)
            m.recv_counts, m.recv_displs = _int_array(size), _int_array(size)
            _to_units(&m, m.send_counts, m.send_displs, [int(c) for c in send_counts], size,
                      item)
            _to_units(&m, m.recv_counts, m.recv_displs, [int(c) for c in recv_counts], size,
                      item)
        return _finish_move(&m, &view, view.data, result.data, comm, "alltoall", view.count,
                            view.kind, NULL, start, out,
                            out_owner if result.lazy else None, (x, _owner, out, out_owner))
    finally:
        _free_move(&m)  # (nothing left to free when a job took the counts)


def gather(x, root=0, *, comm=None, out=None):
    """Every rank's x, in rank order, into out on rank `root` (MPI_Gather); x may be the
    root's part of out (in place). Returns out on the root (new when None), None
    elsewhere."""
    return _gather(x, root, comm, out, False)


def igather(x, root=0, *, comm=None, out=None) -> Request:
    """Start ``gather``; a Request whose wait() returns out on the root, None elsewhere."""
    return _gather(x, root, comm, out, True)


cdef object _gather(object x, root, comm, out, bint start):
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int rank = 0, size = 1
    cdef Move m
    cdef int64_t item
    _resolve_comm(comm, &handle)
    _rank_size(handle, &rank, &size)
    _check_rank(root, size, "root", "gather")
    _owner = acquire(x, &view, False, "x")
    item = _itemsize(&view)
    out_owner = None
    memset(&m, 0, sizeof(Move))
    m.kind, m.comm, m.root, m.divide_kind = MOVE_GATHER, handle, root, -1
    m.send_bytes = view.count * item
    if rank == root:
        out, out_owner = _result_for(x, &view, out, view.count * size, &result, "gather")
        m.in_place = (m.send_bytes > 0 and result.data + rank * m.send_bytes == view.data
                      and not view.lazy and not result.lazy)
        if not m.in_place:
            _check_apart(&view, &result, "gather")
        m.recv_bytes = m.send_bytes * size
        m.reads_recv_first = m.in_place
        m.writes_recv = True
    elif out is not None:
        raise ValueError("fastreduce: gather: out is given on a rank that is not the root; "
                         "only the root receives (pass out=None elsewhere)")
    else:
        result.data = NULL
    _set_unit(&m, item, m.send_bytes, "gather")  # one rank's part
    m.count = m.send_bytes // m.unit_bytes
    if _debug:
        _debug_move(comm, "igather" if start else "gather", &view, None, root, None)
    _agreed(handle)
    return _finish_move(&m, &view, view.data, result.data, comm, "gather", view.count,
                        view.kind, NULL, start, out if rank == root else None,
                        out_owner if rank == root and result.lazy else None,
                        (x, _owner, out, out_owner))


def scatter(x, root=0, *, comm=None, out=None):
    """Part r of x on rank `root` into out on rank r (MPI_Scatter); x is read on the root
    only (None elsewhere), out may be the root's part of x (in place). Returns out (new
    on the root when None; the other ranks must give it)."""
    return _scatter(x, root, comm, out, False)


def iscatter(x, root=0, *, comm=None, out=None) -> Request:
    """Start ``scatter``; a Request whose wait() returns out."""
    return _scatter(x, root, comm, out, True)


cdef object _scatter(object x, root, comm, out, bint start):
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int rank = 0, size = 1
    cdef Move m
    cdef int64_t item
    _resolve_comm(comm, &handle)
    _rank_size(handle, &rank, &size)
    _check_rank(root, size, "root", "scatter")
    x_owner = None
    memset(&m, 0, sizeof(Move))
    m.kind, m.comm, m.root, m.divide_kind = MOVE_SCATTER, handle, root, -1
    if rank == root:
        if x is None:
            raise TypeError("fastreduce: scatter: x is None on the root; give the tensor to "
                            "scatter there")
        x_owner = acquire(x, &view, False, "x")
        if view.count % size:
            raise ValueError(f"fastreduce: scatter: x has {view.count} elements, which do not "
                             f"divide among {size} ranks")
        out, out_owner = _result_for(x, &view, out, view.count // size, &result, "scatter")
        item = _itemsize(&view)
        m.in_place = (result.count > 0 and view.data + rank * result.count * item == result.data
                      and not view.lazy and not result.lazy)
        if not m.in_place:
            _check_apart(&view, &result, "scatter")
        m.send_bytes = view.count * item
    else:
        if out is None:
            raise TypeError("fastreduce: scatter needs out= on the ranks other than the root "
                            "(only the root's x says how much each rank receives)")
        out_owner = acquire(out, &result, True, "out")
        view = result
        item = _itemsize(&result)
    m.recv_bytes = result.count * item
    m.reads_recv_first = False  # in place, the root's part stays where it is in x
    m.writes_recv = not m.in_place
    _set_unit(&m, item, m.recv_bytes, "scatter")  # one rank's part
    m.count = m.recv_bytes // m.unit_bytes
    if _debug:
        _debug_move(comm, "iscatter" if start else "scatter", &result, None, root, None)
    _agreed(handle)
    return _finish_move(&m, &result, view.data if rank == root else NULL, result.data, comm,
                        "scatter", result.count, result.kind, NULL, start, out,
                        out_owner if result.lazy else None, (x, x_owner, out, out_owner))


def send(x, dest, tag=0, *, comm=None):
    """Send x to rank `dest` of comm (MPI_Send: returns once x may be reused)."""
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int rank = 0, size = 1
    cdef Move m
    _resolve_comm(comm, &handle)
    _watch_comm(handle)  # (collectives watch it from their plan)
    _rank_size(handle, &rank, &size)
    _check_rank(dest, size, "dest", "send")
    _check_tag(tag, "send")
    _owner = acquire(x, &view, False, "x")
    memset(&m, 0, sizeof(Move))
    m.kind, m.comm, m.root, m.tag, m.divide_kind = MOVE_SEND, handle, dest, tag, -1
    m.send_bytes = view.count * _itemsize(&view)
    _set_unit(&m, _itemsize(&view), m.send_bytes, "send")
    m.count = m.send_bytes // m.unit_bytes
    _run_move(&m, &view, view.data, NULL, comm, f"send to {dest}", view.count, view.kind,
              NULL)


def recv(x, source=None, tag=None, *, comm=None) -> tuple:
    """Receive into x from rank `source` of comm (None: any rank, through a matched probe)
    with `tag` (None: any tag) (MPI_Recv); returns (source, tag) of the message."""
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int rank = 0, size = 1
    cdef Move m
    _resolve_comm(comm, &handle)
    _watch_comm(handle)  # (collectives watch it from their plan)
    _rank_size(handle, &rank, &size)
    if source is not None:
        _check_rank(source, size, "source", "recv")
    if tag is not None:
        _check_tag(tag, "recv")
    _owner = acquire(x, &view, True, "x")
    memset(&m, 0, sizeof(Move))
    m.kind, m.comm, m.divide_kind = MOVE_RECV, handle, -1
    m.root = MPI_ANY_SOURCE if source is None else source
    m.tag = MPI_ANY_TAG if tag is None else tag
    m.recv_bytes = view.count * _itemsize(&view)
    m.writes_recv = True
    _set_unit(&m, _itemsize(&view), m.recv_bytes, "recv")
    m.count = m.recv_bytes // m.unit_bytes
    peer = "any rank" if source is None else source
    _run_move(&m, &view, NULL, view.data, comm, f"recv from {peer}", view.count, view.kind,
              NULL)
    if view.lazy:
        _write_back(_owner)
    return m.status.MPI_SOURCE, m.status.MPI_TAG


_tag_ub = None  # MPI_TAG_UB: the largest tag this MPI takes (at least 32767)


cdef int _check_tag(object tag, str call) except -1:
    global _tag_ub
    if not isinstance(tag, int) or isinstance(tag, bool) or tag < 0:
        raise ValueError(f"fastreduce: {call}: tag must be a non-negative int, not {tag!r}")
    if _tag_ub is None:
        _tag_ub = _MPI.COMM_WORLD.Get_attr(_MPI.TAG_UB)
    if tag > _tag_ub:
        raise ValueError(f"fastreduce: {call}: tag {tag} is past the largest this MPI takes "
                         f"(MPI_TAG_UB = {_tag_ub}); give a tag from 0 to {_tag_ub}")
    return 0


def isend(x, dest, tag=0, *, comm=None) -> Request:
    """Start sending x to rank `dest` of comm (MPI_Isend); wait() returns x once it may be
    reused. GPU memory not handed to MPI is copied to pinned memory before this returns."""
    return _p2p_start(x, dest, tag, comm, False)


def irecv(x, source, tag=0, *, comm=None) -> Request:
    """Start receiving into x from rank `source` of comm with `tag` (MPI_Irecv); wait()
    returns x once the message is in it. (From any rank: recv, which probes first.)"""
    return _p2p_start(x, source, tag, comm, True)


cdef Request _p2p_start(object x, object peer, object tag, object comm, bint receiving):
    """A started MPI_Isend or MPI_Irecv of x's memory, or of pinned memory for GPU memory
    the path does not hand to MPI (a send's copied in now, a receive's copied out by the
    wait or test that sees it complete), in a Request."""
    cdef str call = "irecv" if receiving else "isend"
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef int rank = 0, size = 1
    cdef Move m
    _resolve_comm(comm, &handle)
    _watch_comm(handle)  # (collectives watch it from their plan)
    _rank_size(handle, &rank, &size)
    _check_rank(peer, size, "source" if receiving else "dest", call)
    _check_tag(tag, call)
    owner = acquire(x, &view, receiving, "x")
    cdef int64_t nbytes = view.count * _itemsize(&view)
    memset(&m, 0, sizeof(Move))
    m.kind = MOVE_RECV if receiving else MOVE_SEND
    m.comm = handle
    if receiving:
        m.recv_bytes = nbytes
    else:
        m.send_bytes = nbytes
    _set_unit(&m, _itemsize(&view), nbytes, call)
    cdef int units = <int>(nbytes // m.unit_bytes)
    cdef Request req = Request.__new__(Request)
    req.handles = <MPI_Request*>malloc(sizeof(MPI_Request))
    if req.handles == NULL:
        raise MemoryError("fastreduce: out of memory for an MPI request")
    req.result, req.keep = x, (x, owner, _storage(x, &view))
    req.comm = default_comm() if comm is None else comm
    req.red, req.count, req.handle = get_reduction(KIND_UINT8, OP_SUM), nbytes, handle
    req.receiving, req.stage_back, req.p2p = receiving, receiving, True
    if receiving:
        req.status.MPI_SOURCE = peer  # named: known without the status (wait_all's too)
    cdef char* buffer = view.data
    cdef cudaStream_t stream = <cudaStream_t>view.stream
    cdef Staging* ctx = NULL
    cdef int dest = peer
    cdef int ctag = tag
    cdef int ierr
    if view.on_device:
        _check_capture(&view, &view)
        if (view.device_type == kDLCUDAManaged
                or _movement_path(&m, comm, &view, NULL) == PATH_DIRECT):
            with nogil:
                stream_sync(stream)
        else:
            ctx = staging_take(view.device_id, max(nbytes, 1))
            try:
                with nogil:
                    staging_order(ctx, stream)  # the pinned memory's last reader has finished
                    if nbytes and not receiving:
                        copy_async(ctx.host, view.data, nbytes, MEMCPY_D2H, stream)
                    stream_sync(stream)
            except BaseException:
                _drain(ctx, stream)
                staging_give(ctx)
                raise
            req.staging, req.device_dst, req.stream = ctx, view.data, stream
            req.own_stream = view.own_stream
            buffer = ctx.host
    with nogil:
        if receiving:
            ierr = MPI_Irecv(buffer, units, m.unit, dest, ctag, handle, &req.handles[0])
        else:
            ierr = MPI_Isend(buffer, units, m.unit, dest, ctag, handle, &req.handles[0])
    if ierr != MPI_SUCCESS:
        if req.staging != NULL:
            staging_give(req.staging)
            req.staging = NULL
        CHKERR(ierr)
    req.nhandles = 1
    req.pending = True
    _pending.add(req)
    if receiving:
        _guard(req, &view, owner)
    if _recording:
        return _recorded(req, comm, f"{call} {'from' if receiving else 'to'} {dest}", &view)
    return req
