"""The progress engine: one thread per process that carries out non-blocking work.

A non-blocking GPU all-reduce must not make the caller wait for the GPU or for MPI, and
MPI's own non-blocking collectives advance only inside later MPI calls. So starting such a
request queues a Job (after queueing its first copies on the GPU), and this thread runs the
jobs one at a time, in the order they were submitted, with the GIL released around every
MPI call and GPU wait. The jobs of a communicator make their MPI calls on a duplicate of it
(made once, collectively, at its first job), so they never interleave with the caller's own
collectives; submitting in the same order on every rank makes every rank's engine issue the
same collectives in the same order.

It needs MPI_THREAD_MULTIPLE (mpi4py asks for it by default). With less, or with
FASTREDUCE_ENGINE=0, non-blocking calls keep to MPI's non-blocking collectives
(enabled() is False). At interpreter exit the queue is drained before MPI is finalized.

A Job reports completion to whoever waits (wait_for) and to its callbacks: the hook a
torch.distributed work object, or any other future, can complete from.
"""

from libc.stdint cimport int64_t

import atexit
import collections
import threading

from mpi4py import MPI

from .algochoice import forget as _forget_plans


cdef class Job:
    """A unit of work for the engine; subclasses implement execute() (and cleanup())."""

    def __cinit__(self):
        self.error = None
        self.done = False
        self.orphaned = False
        self.callbacks = []

    cdef int execute(self) except -1:
        raise NotImplementedError

    cdef int cleanup(self) except -1:
        """After execute(), for a job whose request was dropped: release what it holds."""
        return 0

    def test(self) -> bool:
        """Whether the job is done; never blocks."""
        return self.done

    def wait(self) -> None:
        """Block (GIL released) until the job is done; raise what it raised."""
        wait_for(self)
        if self.error is not None:
            raise self.error

    def add_done_callback(self, fn) -> None:
        """Call fn(job) once the job is done (at once if it is), from the engine's thread,
        possibly just after a wait() for it has returned; fn must not wait for requests."""
        with _cond:
            if not self.done:
                self.callbacks.append(fn)
                return
        fn(self)


cdef class CallJob(Job):
    """A job that calls a Python function on the engine thread (torch.distributed's
    non-blocking collectives other than all-reduce)."""

    cdef object fn

    cdef int execute(self) except -1:
        self.fn()
        return 0

    cdef int cleanup(self) except -1:
        self.fn = None
        return 0


def submit_call(fn) -> Job:
    """Queue fn() for the engine thread (in submission order with every other job); returns
    its Job. fn must not wait for other jobs."""
    cdef CallJob job = CallJob.__new__(CallJob)
    job.fn = fn
    submit(job)
    return job


def wait_job(Job job) -> None:
    """Block (GIL released) until the job is done; raise what it raised (job.wait())."""
    job.wait()


_queue = collections.deque()
_cond = threading.Condition()
_thread = None
_unfinished = 0  # jobs submitted and not done
_stopped = False  # stop() ran: no new thread
_state = None  # (enabled, why), decided once
_setting = None  # set-up's callable: a setting's name -> its parsed value (None: unset)


def set_setting_source(source) -> None:
    """Read FASTREDUCE_ENGINE and FASTREDUCE_ENGINE_HOST_BYTES through `source(name)` (the
    parsed value, None when unset) when first needed; None: take both as unset."""
    global _setting
    _setting = source


def _setting_value(str name):
    return None if _setting is None else _setting(name)


def state() -> tuple:
    """(whether the engine runs non-blocking calls here, why)."""
    global _state
    if _state is None:
        if _setting_value("FASTREDUCE_ENGINE") is False:
            _state = (False, "off (FASTREDUCE_ENGINE=0)")
        elif MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            _state = (False, "off: the MPI gives less than MPI_THREAD_MULTIPLE; non-blocking "
                             "calls use MPI's non-blocking collectives")
        else:
            _state = (True, "on (MPI_THREAD_MULTIPLE)")
    return _state


def set_enabled(value) -> None:
    """Run non-blocking calls on the engine (True: staged GPU requests, and host requests
    as set_host says), not at all (False), or as the environment and the MPI's thread
    level say (None). Requests already started keep their way."""
    global _state
    if value is None:
        _state = None
    elif value and state()[1].startswith("off: the MPI"):
        raise ValueError(f"fastreduce: the progress engine cannot run here: {state()[1]}")
    else:
        _state = (bool(value), "on (set_enabled)" if value else "off (set_enabled)")
    _forget_plans()  # the ranks agree on it again: it decides their MPI calls


cdef bint enabled() except -1:
    return state()[0]


_host_bytes = None  # host requests of at least this many bytes use the engine; -1: none


def set_host(value) -> None:
    """Which non-blocking host requests the engine runs: those of at least `value` bytes
    (an int), all (True), none (False); None: as FASTREDUCE_ENGINE_HOST_BYTES says
    (default 64 KiB: below that, handing a request to the thread costs more than it saves)."""
    global _host_bytes
    if value is None:
        _host_bytes = None
    elif value is True or value is False:
        _host_bytes = 0 if value else -1
    else:
        if int(value) < 0:
            raise ValueError(f"fastreduce: engine host threshold {value}: give bytes >= 0")
        _host_bytes = int(value)
    _forget_plans()  # the ranks agree on it again: it decides their MPI calls


def host_bytes() -> int:
    """The smallest non-blocking host request the engine runs, in bytes; -1: none."""
    global _host_bytes
    if _host_bytes is None:
        setting = _setting_value("FASTREDUCE_ENGINE_HOST_BYTES")  # -1: off
        _host_bytes = DEFAULT_HOST_BYTES if setting is None else setting
    return _host_bytes


DEFAULT_HOST_BYTES = 64 << 10


cdef bint host_enabled(int64_t nbytes) except -1:
    cdef int64_t threshold = _host_bytes if _host_bytes is not None else host_bytes()
    return threshold >= 0 and nbytes >= threshold and state()[0]


def _next():
    """The next queued job (blocking), or None: stop."""
    _cond.acquire()
    try:
        while not _queue:
            _cond.wait()
        return _queue.popleft()
    finally:
        _cond.release()


def _complete(Job job) -> list:
    """Mark the job done, wake its waiters; returns its callbacks."""
    global _unfinished
    callbacks = job.callbacks
    _cond.acquire()
    try:
        _unfinished -= 1
        job.done = True
        job.callbacks = []
        _cond.notify_all()
    finally:
        _cond.release()
    return callbacks


def _process(Job job) -> None:
    """Run one job: execute it, mark it done (waking its waiters), clean up after a dropped
    request, call its callbacks. Errors go to the job (wait() raises them) or are dropped."""
    try:
        job.execute()
    except BaseException as exc:  # noqa: BLE001  (reported by the request's wait())
        job.error = exc
    callbacks = _complete(job)
    if job.orphaned:
        try:
            job.cleanup()
        except BaseException:  # noqa: BLE001  (nobody is left to report it to)
            pass
    for fn in callbacks:
        try:
            fn(job)
        except BaseException:  # noqa: BLE001
            pass


_engine_ident = None  # the engine thread's id, kept after stop() (its last jobs still run)


def _loop() -> None:
    global _engine_ident
    _engine_ident = threading.get_ident()
    while True:
        job = _next()
        if job is None:  # stop()
            return
        _process(job)


cdef int submit(Job job) except -1:
    """Queue a job; the engine thread starts at the first. After stop() (interpreter
    exit) the job runs at once, in the caller's thread."""
    global _thread, _unfinished
    with _cond:
        _unfinished += 1
    if _stopped:
        _process(job)
        return 0
    with _cond:
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="fastreduce-engine", daemon=True)
            _thread.start()
        _queue.append(job)
        _cond.notify_all()
    return 0


cdef bint on_engine_thread() except -1:
    """Whether the caller is the engine's thread."""
    return _engine_ident is not None and threading.get_ident() == _engine_ident


cdef int wait_for(Job job) except -1:
    """Block (GIL released) until the job is done."""
    with _cond:
        while not job.done:
            _cond.wait()
    return 0


def wait_idle() -> None:
    """Block until every job submitted so far is done (dropped requests included)."""
    with _cond:
        while _unfinished:
            _cond.wait()


def stop() -> None:
    """Let the queued jobs finish, then end the thread (at interpreter exit); later jobs run
    in their caller's thread."""
    global _thread, _stopped
    _stopped = True
    thread = _thread
    if thread is None:
        return
    _cond.acquire()
    try:
        _thread = None
        _queue.append(None)
        _cond.notify_all()
    finally:
        _cond.release()
    thread.join()


atexit.register(stop)
