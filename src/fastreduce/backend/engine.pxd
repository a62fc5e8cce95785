# The progress engine: one thread per process that runs queued jobs in the order they
# were submitted (see _engine.pyx).

from libc.stdint cimport int64_t

cdef class Job:
    cdef readonly object error   # what execute() raised, or None
    cdef readonly bint done
    cdef bint orphaned           # its request was dropped: the engine cleans up after it
    cdef list callbacks          # called with the job once it is done (engine thread)

    cdef int execute(self) except -1
    cdef int cleanup(self) except -1

cdef int submit(Job job) except -1
cdef int wait_for(Job job) except -1
cdef bint enabled() except -1
cdef bint host_enabled(int64_t nbytes) except -1
cdef bint on_engine_thread() except -1
