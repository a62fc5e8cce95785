# An all-reduce preceded by the ranks' agreement on it, in one call: fastreduce.horovod's
# fast path (included by collectives.pyx).

# the name fastreduce.horovod's rounds have in the flight record (negotiation.py's too)
_HOROVOD_ROUND = "fastreduce.horovod: a round of the matching by name (MPI_Iallgather)"


def agreed_allreduce(x, op, comm, int64_t status, int64_t digest, int64_t[::1] everyone,
                     bint in_place):
    """Send (status, digest) to every rank of comm and gather theirs into `everyone`
    (MPI_Iallgather, 16 bytes a rank); where every rank sent the same, reduce x over comm
    (in place, or in place on a new copy) and return the result. None where the ranks sent
    different things (`everyone` holds them); False, before any MPI call, where x or op is
    refused (the caller's own checks then refuse it on every rank)."""
    cdef BufferView view, result
    cdef MPI_Comm handle = MPI_COMM_NULL
    cdef const Reduction* red = NULL
    cdef int64_t mine[2]
    cdef MPI_Request exchange = MPI_REQUEST_NULL
    cdef int size = 0, i
    try:
        _owner = _prepare(x, op, comm, in_place, &view, &handle, &red, None)
    except (TypeError, ValueError, BufferError):
        return False
    if view.on_device or view.lazy:
        return False
    CHKERR(MPI_Comm_size(handle, &size))
    if everyone.shape[0] != 2 * size:
        raise ValueError(f"fastreduce: agreed_allreduce: everyone holds {everyone.shape[0]} "
                         f"values; give 2 per rank ({2 * size})")
    mine[0] = status
    mine[1] = digest
    # non-blocking, as every round's exchange is (poll() makes one that does not wait, and
    # MPI matches no blocking collective with a non-blocking one); in the flight record as
    # the layer's own rounds are
    entry = _flight_begin(comm, _HOROVOD_ROUND, 2 * size, KIND_INT64, True)
    try:
        with nogil:
            CHKERR(MPI_Iallgather(mine, 2, MPI_INT64_T, &everyone[0], 2, MPI_INT64_T, handle,
                                  &exchange))
            CHKERR(MPI_Waitall(1, &exchange, MPI_STATUSES_IGNORE))
    except BaseException:
        _flight_end(entry, False)
        raise
    _flight_end(entry, True)
    for i in range(size):
        if everyone[2 * i] != status or everyone[2 * i + 1] != digest:
            return None
    if _debug:  # as the layer's other path, which reduces a copy in place, checks it
        _debug_check(comm, "allreduce_", &view, op)
    if in_place:
        _blocking(&view, &view, MPI_IN_PLACE, red, handle, comm, "allreduce_")
        return x
    # in place on a copy, as the layer's other path reduces: MPI wants MPI_IN_PLACE on
    # every rank of a call or on none
    out = new_like(x, &view, &result)
    memcpy(result.data, view.data, view.count * red.itemsize)
    _blocking(&result, &result, MPI_IN_PLACE, red, handle, comm, "allreduce_")
    return out
