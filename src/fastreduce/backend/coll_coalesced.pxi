# Coalesced all-reduce: many tensors, one MPI call per dtype (included by collectives.pyx).

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
    if hasattr(tensors, "__dlpack__"):  # iterating a tensor would reduce its rows
        raise TypeError(f"fastreduce: allreduce_coalesced_ takes a list of tensors, not one "
                        f"{type(tensors).__qualname__}; pass [tensor], or use allreduce_ for "
                        f"one tensor")
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
            _fingerprint_hook(default_comm() if comm is None else comm, "allreduce_coalesced_",
                              counts={_KIND_NAMES[k]: counts[k] for k in range(NKINDS)
                                      if reds[k] != NULL},
                              op=_op_label(op),
                              device=device_name(views[0].device_type, 0).split(":")[0])
        _agreed(handle)
        if _recording:
            entry = _flight_start(comm, "allreduce_coalesced_",
                                  sum([counts[k] for k in range(NKINDS)]), -1,
                                  "+".join([_KIND_NAMES[k] for k in range(NKINDS)
                                            if reds[k] != NULL]), True)
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
