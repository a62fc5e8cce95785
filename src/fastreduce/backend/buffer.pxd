# A tensor's memory as fastreduce hands it to MPI, read through DLPack.

from libc.stdint cimport int32_t, int64_t

from .dlpack cimport DLDataType, DLPackExchangeAPI

ctypedef struct BufferView:
    char* data                    # first element (DLPack data + byte_offset)
    int64_t count                 # number of elements
    int kind                      # _dtypes.Kind
    DLDataType dtype
    int32_t ndim
    const int64_t* shape          # borrowed: valid while the object (or owner) lives
    int32_t device_type
    int32_t device_id
    const DLPackExchangeAPI* api  # the C exchange API of the object's type, or NULL
    bint on_device                # CUDA device or managed memory (not host, not pinned host)
    void* stream                  # GPU memory: the stream whose queued work produced it
    bint own_stream               # `stream` is fastreduce's: finish on the host before return
    bint torch                    # a torch tensor (its storage can be swapped: set_, resize_)
    # LAZY_* bits of the object read; `data` is then a resolved copy's (the owner acquire
    # returns is a Resolved)
    int lazy

# torch's lazy views: the memory holds the conjugate / the negation of the values
cdef enum:
    LAZY_CONJ = 1
    LAZY_NEG = 2


cdef class Resolved:
    """A lazy view's values resolved into a copy, written back into the view on request."""
    cdef readonly object view
    cdef readonly object copy
    cdef int write_back(self) except -1


cdef str device_name(int device_type, int device_id)
cdef object acquire(object obj, BufferView* view, bint writable, str role)
cdef object new_like(object obj, BufferView* view, BufferView* out)
cdef int check_same_layout(BufferView* x, BufferView* out) except -1
