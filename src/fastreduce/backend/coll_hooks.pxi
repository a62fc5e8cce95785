# The Python core's hooks: debug mode's check and the flight record (included by
# collectives.pyx). The Python core installs them at set-up; the hot path tests one bint.

# --- debug mode (FASTREDUCE_DEBUG=1, fastreduce.set_debug): every rank agrees on each call
cdef bint _debug = False
cdef object _fingerprint_hook = None  # fingerprint(comm, call, **fields): fastreduce.checks'


def set_debug_hook(fn) -> None:
    """Debug mode's check, fn(comm, call, **fields), run before every call; None: off."""
    global _debug, _fingerprint_hook
    _fingerprint_hook = fn
    _debug = fn is not None


cdef str _op_label(object op):
    """The op as every rank names it (an mpi4py Op by its handle number, not its address)."""
    return op if isinstance(op, str) else f"MPI.Op {op.py2f()}"


cdef int _debug_check(object comm, str call, BufferView* view, object op) except -1:
    """Debug mode: the ranks of comm agree on this call's fingerprint."""
    _fingerprint_hook(default_comm() if comm is None else comm, call, count=view.count,
                      dtype=_KIND_NAMES[view.kind], op=_op_label(op),
                      device=device_name(view.device_type, view.device_id).split(":")[0])
    return 0


# --- flight record (FASTREDUCE_TIMEOUT, fastreduce.watchdog): only while a timeout is set
cdef bint _recording = False
cdef object _begin_hook = None      # begin(call, comm, count, dtype, blocking) -> entry
cdef object _recorded_hook = None   # recorded(call, comm): a context around a set-up collective
cdef object _waiting_hook = None    # waiting(entry): a request's wait() has begun


def set_flight_hooks(begin, recorded, waiting) -> None:
    """The flight record's hooks (fastreduce.watchdog's begin, recorded and waiting), which
    turn recording on; all None: off."""
    global _recording, _begin_hook, _recorded_hook, _waiting_hook
    if (begin is None) != (recorded is None) or (begin is None) != (waiting is None):
        raise ValueError("fastreduce: give all three flight-record hooks, or None for each")
    _begin_hook, _recorded_hook, _waiting_hook = begin, recorded, waiting
    _recording = begin is not None


cdef object _flight_begin(object comm, str call, int64_t count, int kind, bint blocking):
    return _begin_hook(call, comm, count, _KIND_NAMES[kind], blocking)


cdef object _setup_recorded(str call, object comm):
    """A context recording a set-up collective while a timeout is set."""
    if not _recording:
        return nullcontext()
    return _recorded_hook(call, comm)


cdef int _flight_waiting(object entry) except -1:
    """A recorded request's wait() has begun (recording may have been turned off since)."""
    if _waiting_hook is not None:
        _waiting_hook(entry)
    return 0


cdef void _flight_end(object entry, bint ok) noexcept:
    if entry is not None:
        entry.state = "done" if ok else "failed"
        entry.waiting_since = None
