# Which way a GPU all-reduce goes: device pointers straight to MPI ("direct") or through
# pinned host memory ("staged"). Decided in C per call; the settings, the table of what
# each MPI promises and the calibration are fastreduce.gpupaths' (Python), read once.

from libc.stdint cimport int64_t

from .libmpi cimport MPI_Comm
from .reductions cimport Reduction

cdef enum:
    PATH_STAGED = 0
    PATH_DIRECT = 1

cdef int choose_path(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                     const Reduction* red, int kind) except -1
cdef int choose_movement_path(object comm, MPI_Comm handle, int64_t nbytes, bint nonblocking,
                              int kind, const Reduction* red, bint collective) except -1
