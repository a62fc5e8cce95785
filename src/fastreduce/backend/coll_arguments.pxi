# The default communicator, comm and argument checks, and a lazy view's write-back
# (included by collectives.pyx).

cdef MPI_Comm _default_handle = MPI_COMM_NULL
cdef object _default_comm = None


def default_comm():
    """The communicator used when comm=None: a duplicate of COMM_WORLD, made once (collective)."""
    global _default_comm, _default_handle
    _refuse_if_finalized()
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
    if _finalized:
        _refuse_if_finalized()
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
    if _freed and _is_freed(handle):
        raise ValueError("fastreduce: comm was freed (through another mpi4py object of the "
                         "same communicator: MPI.Comm(c) shares c's handle); pass a live "
                         "communicator")
    out[0] = handle
    return 0


cdef inline int _agreed(MPI_Comm handle) except -1:
    """Before a collective: the settings that choose each rank's MPI calls, agreed by the
    communicator's ranks at its first collective (then a cached look-up); where they differ
    every rank raises SettingError. Not for send and recv, which the other ranks do not
    join."""
    plan_for(handle)
    return 0


cdef inline object _prepare(object x, object op, object comm, bint writable,
                            BufferView* view, MPI_Comm* handle, const Reduction** red,
                            object compression=None):
    """Validate op, compression, comm and x (in that order, before any MPI call); returns
    x's owner."""
    cdef int code = op_code(op)
    cdef int wire = compression_code(compression)
    _resolve_comm(comm, handle)
    owner = acquire(x, view, writable, "x")
    red[0] = get_reduction(view.kind, code)
    if wire:
        red[0] = get_compressed(red[0], view.kind, code, wire)
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
