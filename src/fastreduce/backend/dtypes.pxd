# Element kinds fastreduce reduces, and their mapping from DLPack dtypes.

from libc.stdint cimport uint8_t, uint16_t

from .dlpack cimport kDLBfloat, kDLBool, kDLComplex, kDLFloat, kDLInt, kDLUInt

cdef enum Kind:
    KIND_BOOL
    KIND_INT8
    KIND_INT16
    KIND_INT32
    KIND_INT64
    KIND_UINT8
    KIND_UINT16
    KIND_UINT32
    KIND_UINT64
    KIND_FLOAT16
    KIND_BFLOAT16
    KIND_FLOAT32
    KIND_FLOAT64
    KIND_COMPLEX64
    KIND_COMPLEX128

# How many kinds: an array dimension. In an anonymous enum (a plain int constant),
# since Cython 3.1/3.2 reject a named enum's value as an array dimension
# ("Array dimension not integer").
cdef enum:
    NKINDS = KIND_COMPLEX128 + 1

cdef inline int kind_from_dlpack(uint8_t code, uint8_t bits, uint16_t lanes) noexcept nogil:
    """The Kind of a DLPack dtype, or -1 when fastreduce does not reduce it."""
    if lanes != 1:
        return -1
    if code == kDLFloat:
        if bits == 32:
            return KIND_FLOAT32
        if bits == 64:
            return KIND_FLOAT64
        if bits == 16:
            return KIND_FLOAT16
    elif code == kDLBfloat:
        if bits == 16:
            return KIND_BFLOAT16
    elif code == kDLInt:
        if bits == 32:
            return KIND_INT32
        if bits == 64:
            return KIND_INT64
        if bits == 8:
            return KIND_INT8
        if bits == 16:
            return KIND_INT16
    elif code == kDLUInt:
        if bits == 8:
            return KIND_UINT8
        if bits == 16:
            return KIND_UINT16
        if bits == 32:
            return KIND_UINT32
        if bits == 64:
            return KIND_UINT64
    elif code == kDLComplex:
        if bits == 64:
            return KIND_COMPLEX64
        if bits == 128:
            return KIND_COMPLEX128
    elif code == kDLBool:
        if bits == 8:
            return KIND_BOOL
    return -1
