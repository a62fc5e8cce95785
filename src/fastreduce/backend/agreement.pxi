# The Python side of a record the ranks of a communicator agree on (commrecord.pxd),
# included by algochoice.pyx and pathchoice.pyx, each with its own copy of what follows:
# the agreement the Python core installs at set-up, the generation of the settings
# (bumped by forget(): every communicator agrees again at its next call) and the
# communicator attribute that keeps the record. The including module defines
# `cdef int _free_record(MPI_Comm, int, void*, void*) noexcept nogil` (frees a record)
# and `cdef void _forgotten() noexcept nogil` (what else forget() invalidates).

cdef int64_t _generation = 1
cdef int _keyval = MPI_KEYVAL_INVALID
_agreement = None  # set-up's callable: comm -> what every rank of comm agreed on


def set_agreement(agreement) -> None:
    """Install `agreement(comm)`, the collective that gives what every rank of comm agreed
    on (see the module's documentation); asked at a communicator's first call and again
    after forget()."""
    global _agreement
    _agreement = agreement
    forget()


def forget() -> None:
    """Settings changed: each communicator agrees on them again at its next call."""
    global _generation
    _generation += 1
    _forgotten()


cdef inline void* _kept(MPI_Comm handle) except? NULL:
    """The communicator's record of this generation, or NULL."""
    return cached_record(handle, &_keyval, _free_record, _generation)


cdef inline int _keep(MPI_Comm handle, void* record) except -1:
    """Attach a record made now (tagged with this generation) to the communicator."""
    (<RecordHead*>record).generation = _generation
    return keep_record(handle, _keyval, _free_record, record)


cdef object _agree_now(object comm, str what):
    """What every rank of comm agrees on, asked now (collective)."""
    if _agreement is None:
        raise RuntimeError(f"fastreduce: no {what} agreement installed (set_agreement)")
    return _agreement(comm)
