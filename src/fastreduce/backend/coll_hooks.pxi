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


# --- flight record (FASTREDUCE_TIMEOUT, fastreduce.watchdog): kept here, in C, while a
# timeout is set (the default): the last calls in a ring, each a few stores and a clock
# read. The call's name and communicator sit in two lists beside it (names and
# communicators are Python objects); the watchdog's thread reads the ring with the GIL,
# which every writer holds too.
cdef enum:
    FLIGHT_IN_MPI = 0
    FLIGHT_STARTED = 1
    FLIGHT_WAITING = 2
    FLIGHT_DONE = 3
    FLIGHT_FAILED = 4

ctypedef struct FlightEntry:
    int64_t number     # 1, 2, ... (0: an empty slot)
    int64_t count
    double started     # seconds since the epoch
    double waiting_since  # since when it can be stuck (0: it cannot: done, or not waited for)
    int kind           # the element kind, or -1: the text in _flight_dtypes
    int state          # FLIGHT_*

_FLIGHT_STATES = ("in MPI", "started", "waiting", "done", "failed")
cdef bint _recording = False
cdef FlightEntry* _flight = NULL
cdef int64_t _flight_size = 0   # slots: a power of two, at least the size asked for
cdef int64_t _flight_mask = 0   # _flight_size - 1: a call's slot is its number & mask
cdef int64_t _flight_kept = 0   # the size asked for: what the record shows
cdef int64_t _flight_next = 1
cdef list _flight_calls = []
cdef list _flight_comms = []
cdef list _flight_dtypes = []
cdef object _recorded_hook = None   # recorded(call, comm): a context around a set-up collective


cdef extern from "<time.h>" nogil:
    enum: CLOCK_REALTIME_COARSE  # the last tick (a few ms): enough for a bound in seconds


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME_COARSE, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


def set_flight_record(int64_t size, recorded) -> None:
    """Keep the last `size` calls or more (0: record nothing); `recorded(call, comm)`: the
    Python core's context around a set-up collective (fastreduce.watchdog.recorded)."""
    global _recording, _flight, _flight_size, _flight_calls, _flight_comms, _flight_dtypes
    global _recorded_hook, _flight_mask, _flight_kept
    if size < 0:
        raise ValueError(f"fastreduce: flight record of {size} calls: give 0 or more")
    _flight_kept = size
    if size:
        size = 1 << (size - 1).bit_length()  # a power of two: a slot is a mask away
    if size != _flight_size:
        free(_flight)
        _flight = NULL
        _flight_size = 0
        if size:
            _flight = <FlightEntry*>calloc(size, sizeof(FlightEntry))
            if _flight == NULL:
                raise MemoryError(f"fastreduce: no memory for a flight record of {size} calls")
        _flight_size = size
        _flight_mask = size - 1
        _flight_calls = [None] * size
        _flight_comms = [None] * size
        _flight_dtypes = [None] * size
    _recorded_hook = recorded
    _recording = size > 0 and recorded is not None


cdef int64_t _flight_start(object comm, str call, int64_t count, int kind, str dtype,
                           bint blocking) except -1:
    global _flight_next
    cdef int64_t number = _flight_next
    cdef int64_t slot = number & _flight_mask
    cdef FlightEntry* e = &_flight[slot]
    _flight_next += 1
    e.number = number
    e.count = count
    e.kind = kind
    e.started = _now()
    e.waiting_since = e.started if blocking else 0.0
    e.state = FLIGHT_IN_MPI if blocking else FLIGHT_STARTED
    if _flight_calls[slot] is not call:  # (the same call again: no reference to move)
        _flight_calls[slot] = call
    if _flight_comms[slot] is not comm:
        _flight_comms[slot] = comm
    if kind < 0:
        _flight_dtypes[slot] = dtype
    return number


cdef object _flight_begin(object comm, str call, int64_t count, int kind, bint blocking):
    """Record a call as it starts (blocking: in MPI now); its number (None: not recording)."""
    if not _recording:
        return None
    return _flight_start(comm, call, count, kind, None, blocking)


cdef inline FlightEntry* _flight_slot(int64_t number) noexcept:
    """The slot still holding call `number`'s entry, else NULL (overwritten, or none)."""
    if number <= 0 or _flight_size == 0:
        return NULL
    cdef FlightEntry* e = &_flight[number & _flight_mask]
    return e if e.number == number else NULL


cdef inline FlightEntry* _flight_entry(object entry) noexcept:
    return NULL if entry is None else _flight_slot(entry)


cdef inline int64_t _flight_blocking(object comm, str call, int64_t count, int kind) except -1:
    """A blocking call's entry number (0: not recording), without a Python object."""
    return _flight_start(comm, call, count, kind, None, True) if _recording else 0


cdef inline void _flight_done(int64_t number, bint ok) noexcept:
    cdef FlightEntry* e = _flight_slot(number)
    if e != NULL:
        e.state = FLIGHT_DONE if ok else FLIGHT_FAILED
        e.waiting_since = 0.0


cdef object _setup_recorded(str call, object comm):
    """A context recording a set-up collective while a timeout is set."""
    if not _recording:
        return nullcontext()
    return _recorded_hook(call, comm)


cdef int _flight_waiting(object entry) except -1:
    """A recorded request's wait() has begun: from now on it can be stuck."""
    cdef FlightEntry* e = _flight_entry(entry)
    if e != NULL and e.state == FLIGHT_STARTED:
        e.waiting_since = _now()
        e.state = FLIGHT_WAITING
    return 0


cdef void _flight_end(object entry, bint ok) noexcept:
    if entry is not None:
        _flight_done(entry, ok)


def flight_begin(str call, comm, int64_t count, str dtype, bint blocking=True):
    """Record a call made outside the core (a set-up collective); its number, or None."""
    if not _recording:
        return None
    return _flight_start(comm, call, count, -1, dtype, blocking)


def flight_end(entry, bint ok=True) -> None:
    """The recorded call `entry` (flight_begin's number) is done (ok) or failed."""
    _flight_end(entry, ok)


def flight_waiting(entry) -> None:
    """The recorded call `entry` is being waited for: from now on it can be stuck."""
    _flight_waiting(entry)


def flight_entries() -> list:
    """The record, oldest first: (number, call, comm, count, dtype, started, waiting_since
    or None, state) per call; comm the object the call was given (None: the default)."""
    cdef int64_t first = max(1, _flight_next - _flight_kept), number
    cdef FlightEntry* e
    entries = []
    for number in range(first, _flight_next):
        e = &_flight[number & _flight_mask]
        if e.number != number:
            continue
        slot = number & _flight_mask
        entries.append((number, _flight_calls[slot], _flight_comms[slot], e.count,
                        _flight_dtypes[slot] if e.kind < 0 else _KIND_NAMES[e.kind],
                        e.started, e.waiting_since if e.waiting_since else None,
                        _FLIGHT_STATES[e.state]))
    return entries


# Bounds of their own on some communicators (a torch.distributed group's timeout), in C so
# that the watchdog's look at the record allocates nothing (a thread that allocates every
# second shows in every measurement of allocations). Each keeps the mpi4py object it was set
# on, and counts only while that object still holds the handle: once it is freed
# (Comm.Free() sets its handle to MPI_COMM_NULL), a new communicator that MPI gives the same
# handle is not bounded by it. No MPI attribute is used for that: a delete callback that
# needs the GIL can deadlock with a thread that holds the GIL and waits in MPI.
ctypedef struct CommBound:
    intptr_t handle
    double seconds
    PyObject* comm  # a reference, dropped with the bound

cdef CommBound* _bounds = NULL
cdef int _nbounds = 0
cdef int _bounds_room = 0


def set_comm_bound(comm, double seconds) -> int:
    """Bound the calls on comm at `seconds` too (flight_stuck); returns the key that
    clear_comm_bound takes (it works after comm is freed)."""
    global _nbounds, _bounds, _bounds_room
    cdef intptr_t handle = comm_bound_key(comm)
    cdef int i
    cdef CommBound* grown
    if seconds <= 0:
        raise ValueError(f"fastreduce: a bound of {seconds} s: give seconds > 0")
    for i in range(_nbounds):
        if _bounds[i].handle == handle:  # (the same communicator, or a freed one's handle)
            Py_INCREF(comm)
            Py_XDECREF(_bounds[i].comm)
            _bounds[i].comm = <PyObject*>comm
            _bounds[i].seconds = seconds
            return handle
    if _nbounds == _bounds_room:
        grown = <CommBound*>realloc(_bounds, max(16, 2 * _bounds_room) * sizeof(CommBound))
        if grown == NULL:
            raise MemoryError("fastreduce: out of memory for the communicators' bounds")
        _bounds, _bounds_room = grown, max(16, 2 * _bounds_room)
    Py_INCREF(comm)
    _bounds[_nbounds].handle = handle
    _bounds[_nbounds].seconds = seconds
    _bounds[_nbounds].comm = <PyObject*>comm
    _nbounds += 1
    return handle


def comm_bound_key(comm) -> int:
    """The key set_comm_bound returns for comm."""
    return <intptr_t>(<MPI.Comm?>comm).ob_mpi


def clear_comm_bound(intptr_t key) -> None:
    """Remove the bound set_comm_bound returned `key` for (none: nothing)."""
    global _nbounds
    cdef int i
    cdef PyObject* comm
    for i in range(_nbounds):
        if _bounds[i].handle == key:
            comm = _bounds[i].comm
            _nbounds -= 1
            _bounds[i] = _bounds[_nbounds]
            Py_XDECREF(comm)  # (last: a finalizer it runs may set or clear bounds)
            return


def comm_bound_seconds(comm) -> float:
    """comm's own bound in seconds, 0.0 where it has none (or its bound's communicator
    was freed)."""
    cdef double limit = _bound_of(comm, 0.0)
    return 0.0 if limit == INFINITY else limit


cdef double _bound_of(object comm, double timeout):
    """The sooner of timeout (0: none) and comm's own bound (INFINITY: neither)."""
    cdef double limit = timeout if timeout > 0 else INFINITY
    cdef intptr_t handle
    cdef int i
    if _nbounds and comm is not None:
        handle = <intptr_t>(<MPI.Comm>comm).ob_mpi
        for i in range(_nbounds):
            if _bounds[i].handle == handle and _bounds[i].seconds < limit and \
                    <intptr_t>(<MPI.Comm>_bounds[i].comm).ob_mpi == handle:
                limit = _bounds[i].seconds
    return limit


def flight_stuck(double timeout):
    """The number of the oldest call waited for longer than its bound, or None: `timeout`
    seconds (0: none), or its communicator's own where sooner (set_comm_bound)."""
    cdef double now = _now()
    cdef int64_t first = max(1, _flight_next - _flight_kept), number
    cdef FlightEntry* e
    for number in range(first, _flight_next):
        e = &_flight[number & _flight_mask]
        if e.number == number and e.waiting_since and \
                now - e.waiting_since > _bound_of(_flight_comms[number & _flight_mask],
                                                  timeout):
            return number
    return None
