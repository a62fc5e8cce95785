# Communicators and MPI itself ending under fastreduce (included by collectives.pyx):
# MPI_Finalize, a communicator freed with requests pending, and a freed communicator
# reached through another handle of it. Each is seen by an attribute whose delete callback
# MPI runs (MPI_Finalize deletes MPI_COMM_SELF's attributes first thing), never replaced
# once set, so no per-call cost but one C test.

cdef bint _finalized = False   # MPI_Finalize has begun
cdef int _lifetime_keyval = MPI_KEYVAL_INVALID
cdef set _freed = set()  # keys of handles freed while watched (may be reused: _is_freed)
# Open MPI deletes a communicator's attributes in MPI_Comm_free, with requests still
# pending on it (and then fails at its next progress call): they are completed there, and
# its handle table tells a freed handle from one a new communicator reuses. MPICH deletes
# them once the communicator's operations are done, from inside the MPI call that completed
# the last one (where no MPI call may be made: they complete by themselves), and its
# handles are their own table index: nothing to watch there.
cdef bint _watch_lifetimes = _MPI.get_vendor()[0] == "Open MPI"


cdef int _finalizing(MPI_Comm comm, int keyval, void* value, void* extra) noexcept nogil:
    global _finalized
    _finalized = True
    return MPI_SUCCESS


cdef int _watch_finalize() except -1:
    cdef int keyval = MPI_KEYVAL_INVALID
    CHKERR(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, _finalizing, &keyval, NULL))
    CHKERR(MPI_Comm_set_attr(MPI_COMM_SELF, keyval, NULL))
    return 0


cdef int _refuse_if_finalized() except -1:
    if _finalized:
        raise RuntimeError("fastreduce: MPI has been finalized (MPI.Finalize() ran), so no "
                           "fastreduce call can run any more; finalize MPI only once done "
                           "with fastreduce (mpi4py finalizes it at exit by itself)")
    return 0


cdef inline int64_t _handle_key(MPI_Comm handle) noexcept nogil:
    """The handle as a number (a pointer in Open MPI, an int in MPICH)."""
    cdef int64_t key = 0
    memcpy(&key, &handle, sizeof(MPI_Comm))
    return key


cdef int _freeing(MPI_Comm comm, int keyval, void* value, void* extra) noexcept nogil:
    """A watched communicator is being freed (still valid now)."""
    if not Py_IsInitialized():
        return MPI_SUCCESS
    with gil:
        _complete_pending_on(comm)
        _freed.add(_handle_key(comm))
    return MPI_SUCCESS


cdef void _complete_pending_on(MPI_Comm comm) noexcept:
    """Complete the collective requests MPI still has on comm before it goes (every rank
    frees it, so every rank completes them here): a later wait() returns the result, and
    nothing is left for MPI to progress on a freed communicator (Open MPI 5 crashed at its
    next call): Open MPI's case (_watch_lifetimes). The engine's requests run on its own
    duplicate, freed after them."""
    cdef Request req
    cdef int ierr
    cdef MPI_Status* statuses
    # only comm's own: no other request may be held here past a release of the GIL (its
    # last reference dropped meanwhile, it would be completed inside this MPI_Comm_free)
    mine = [obj for obj in _pending if (<Request>obj).pending and (<Request>obj).job is None
            and (<Request>obj).handles != NULL and not (<Request>obj).p2p
            and (<Request>obj).handle == comm]
    for obj in mine:
        req = <Request>obj
        if not req.pending:
            continue
        statuses = &req.status if req.nhandles == 1 else MPI_STATUSES_IGNORE
        with nogil:
            ierr = MPI_Waitall(req.nhandles, req.handles, statuses)
        try:
            req._finish(ierr)
        except BaseException as exc:  # noqa: BLE001  (raised by the request's wait())
            req.late_error = exc


cdef int _watch_comm(MPI_Comm handle) except -1:
    """Watch a communicator's lifetime (from its first collective, or send/recv on it)."""
    global _lifetime_keyval
    cdef void* value = NULL
    cdef int found = 0
    if not _watch_lifetimes:
        return 0
    if _lifetime_keyval == MPI_KEYVAL_INVALID:
        CHKERR(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, _freeing, &_lifetime_keyval,
                                      NULL))
    CHKERR(MPI_Comm_get_attr(handle, _lifetime_keyval, &value, &found))
    if not found:
        CHKERR(MPI_Comm_set_attr(handle, _lifetime_keyval, <void*>1))
        _freed.discard(_handle_key(handle))  # a live communicator reusing a freed handle
    return 0


def _plan_made(comm) -> None:
    """algochoice's hook: a communicator has its first plan."""
    _watch_comm((<MPI.Comm>comm).ob_mpi)


def comm_is_live(comm) -> bool:
    """Whether an mpi4py communicator's handle still names a communicator (a handle freed
    through another object of it does not): for reading a name the flight record keeps.
    Open MPI's handle table answers; MPICH's handles are their own index (True: ask MPI,
    which refuses a freed one with an error)."""
    cdef MPI_Comm handle = (<MPI.Comm?>comm).ob_mpi
    return handle != MPI_COMM_NULL and _in_handle_table(handle)


cdef inline bint _in_handle_table(MPI_Comm handle) noexcept:
    """Whether the MPI's handle table names handle (Open MPI; MPICH: always)."""
    return MPI_Comm_f2c(MPI_Comm_c2f(handle)) == handle


cdef bint _is_freed(MPI_Comm handle) except -1:
    """Whether handle is a communicator freed through another of its handles. A handle
    freed while watched may have been reused by a new communicator: where the MPI's handle
    table says handle is live (Open MPI's f2c(c2f(handle))) it is; MPICH's handles are
    their own table index, so it cannot tell, and MPICH's own check of the call answers."""
    cdef int64_t key = _handle_key(handle)
    if key not in _freed:
        return False
    if _in_handle_table(handle):
        _freed.discard(key)
        return False
    return True
