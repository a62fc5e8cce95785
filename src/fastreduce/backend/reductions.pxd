# Reduction operations: names to codes, and (element kind, op) to the MPI
# datatype and MPI_Op that carry it out.

from .libmpi cimport MPI_Datatype, MPI_Op

cdef enum OpCode:
    OP_SUM
    OP_PROD
    OP_MIN
    OP_MAX
    OP_AVG
    OP_BAND
    OP_BOR
    OP_BXOR

# How many ops: an array dimension, so a plain int constant (see NKINDS in _dtypes.pxd).
cdef enum:
    NOPS = OP_BXOR + 1

ctypedef struct Reduction:
    MPI_Datatype datatype
    MPI_Op op
    int itemsize
    int divide_kind   # FR_SCALE_* of _halfops.h for op "avg", else -1
    bint predefined   # MPI's own op: usable with the large-count call
    int opcode        # OP_* (avg: OP_SUM, divided afterwards)
    int wire          # FR_WIRE_* of algorithms.h: float32 sent as 16 bits (compression)
    MPI_Datatype wire_datatype  # ... and how the 16-bit values reduce inside MPI
    MPI_Op wire_op

cdef int op_code(object op) except -1
cdef const Reduction* get_reduction(int kind, int op) except NULL
cdef int compression_code(object compression) except -1
cdef const Reduction* get_compressed(const Reduction* red, int kind, int op,
                                     int wire) except NULL
