# Blocking all-reduce: allreduce_ and allreduce (included by collectives.pyx).

cdef int _blocking(BufferView* view, BufferView* result, const void* sendbuf,
                   const Reduction* red, MPI_Comm handle, object comm, str call) except -1:
    """The blocking all-reduce of view into result (host or GPU path), in the flight record
    while a timeout is set."""
    cdef int64_t entry = _flight_blocking(comm, call, view.count, view.kind)
    try:
        if not view.on_device:
            _run(sendbuf, result.data, view.count, red, handle)
        else:
            _device_run(view, result, sendbuf, red, handle, comm)
    except BaseException:
        _flight_done(entry, False)
        raise
    _flight_done(entry, True)
    return 0


def allreduce_(x, op="sum", *, comm=None, compression=None):
    """Reduce x over all ranks of comm in place (MPI_IN_PLACE) and return x; compression
    "bf16" or "fp16" sends float32 as 16 bits."""
    cdef BufferView view
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    _owner = _prepare(x, op, comm, True, &view, &handle, &red, compression)
    if _debug:
        _debug_check(comm, "allreduce_", &view, op)
    _agreed(handle)
    _blocking(&view, &view, MPI_IN_PLACE, red, handle, comm, "allreduce_")
    if view.lazy:
        _write_back(_owner)
    return x


def allreduce(x, op="sum", *, comm=None, out=None, compression=None):
    """Return the reduction of x over all ranks of comm, in a new tensor or in `out`; x is
    kept; compression "bf16" or "fp16" sends float32 as 16 bits."""
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    _owner = _prepare(x, op, comm, False, &view, &handle, &red, compression)
    out_owner = None
    if out is None:
        out = new_like(x, &view, &result)
    else:
        out_owner = _prepare_out(out, &view, &result)
    cdef const void* sendbuf = _send_buffer(&view, &result, red)
    if _debug:
        _debug_check(comm, "allreduce", &view, op)
    _agreed(handle)
    _blocking(&view, &result, sendbuf, red, handle, comm, "allreduce")
    if result.lazy:
        _write_back(out_owner)
    return out
