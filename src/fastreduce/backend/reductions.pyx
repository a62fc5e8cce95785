"""Reduction operations and the MPI datatypes that carry each element kind."""

from mpi4py cimport MPI

from .dtypes cimport (
    KIND_BFLOAT16, KIND_BOOL, KIND_COMPLEX64, KIND_COMPLEX128, KIND_FLOAT16, KIND_FLOAT32,
    KIND_FLOAT64, KIND_INT8, KIND_INT16, KIND_INT32, KIND_INT64, KIND_UINT8, KIND_UINT16,
    KIND_UINT32, KIND_UINT64, NKINDS,
)
from .mpierrors cimport CHKERR
from .libmpi cimport *

from libc.stdint cimport uint16_t

from .algochoice import forget as _forget_plans

cdef extern from "algorithms.h" nogil:
    enum:
        FR_WIRE_NONE
        FR_WIRE_F16
        FR_WIRE_BF16

cdef extern from "halfops.h" nogil:
    MPI_User_function fr_f16_sum
    MPI_User_function fr_f16_prod
    MPI_User_function fr_f16_min
    MPI_User_function fr_f16_max
    MPI_User_function fr_bf16_sum
    MPI_User_function fr_bf16_prod
    MPI_User_function fr_bf16_min
    MPI_User_function fr_bf16_max
    uint16_t fr_f32_to_f16(float)
    uint16_t fr_f32_to_bf16(float)
    float fr_f16_to_f32(uint16_t)
    float fr_bf16_to_f32(uint16_t)
    enum:
        FR_SCALE_F16
        FR_SCALE_BF16
        FR_SCALE_F32
        FR_SCALE_F64
        FR_SCALE_C64
        FR_SCALE_C128


OP_NAMES = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
KIND_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)
cdef dict _op_by_name = {name: code for code, name in enumerate(OP_NAMES)}
cdef str _SUM = "sum"

# How each (element kind, op) is reduced; op MPI_OP_NULL: not defined for the kind.
cdef Reduction _table[NKINDS][NOPS]
cdef dict _half_paths = {}


cdef int op_code(object op) except -1:
    """OpCode of a name ("sum", ...) or an mpi4py predefined MPI.Op."""
    if op is _SUM:
        return OP_SUM
    if isinstance(op, str):
        code = _op_by_name.get(op)
        if code is None:
            code = _op_by_name.get(op.lower())
        if code is None:
            raise ValueError(
                f"fastreduce: unknown reduction op {op!r}; use one of {', '.join(OP_NAMES)}")
        return code
    if isinstance(op, MPI.Op):
        return _op_code_from_mpi(<MPI_Op>(<MPI.Op>op).ob_mpi)
    raise TypeError(
        f"fastreduce: op must be a name ({', '.join(OP_NAMES)}) or a predefined mpi4py "
        f"MPI.Op, not {type(op).__name__}")


cdef int _op_code_from_mpi(MPI_Op h) except -1:
    if h == MPI_SUM:
        return OP_SUM
    if h == MPI_PROD:
        return OP_PROD
    if h == MPI_MIN:
        return OP_MIN
    if h == MPI_MAX:
        return OP_MAX
    if h == MPI_BAND or h == MPI_LAND:
        return OP_BAND
    if h == MPI_BOR or h == MPI_LOR:
        return OP_BOR
    if h == MPI_BXOR or h == MPI_LXOR:
        return OP_BXOR
    raise ValueError(
        "fastreduce: only the predefined MPI.SUM, PROD, MIN, MAX, BAND, BOR, BXOR (and the "
        "logical LAND, LOR, LXOR) are supported as MPI.Op; for an average use op='avg'")


cdef const Reduction* get_reduction(int kind, int op) except NULL:
    """How to reduce elements of `kind` with `op`; ValueError when op is not defined for it."""
    cdef const Reduction* red = &_table[kind][op]
    if red.op == MPI_OP_NULL:
        raise ValueError(_undefined_message(kind, op))
    return red


def _undefined_message(int kind, int op) -> str:
    name, opname = KIND_NAMES[kind], OP_NAMES[op]
    if opname == "avg":
        return (f"fastreduce: op 'avg' is defined for floating and complex dtypes, not "
                f"{name}; use op='sum' and divide, or convert to a floating dtype")
    if kind == KIND_BOOL:
        hint = "bool supports band, bor, bxor (logical and/or/xor), min and max"
    elif kind in (KIND_COMPLEX64, KIND_COMPLEX128):
        hint = "complex dtypes support sum, prod and avg"
    elif opname in ("band", "bor", "bxor"):
        hint = "bitwise ops are defined for integer and bool dtypes"
    else:
        hint = "convert the tensor to a dtype that supports it"
    return f"fastreduce: op {opname!r} is not defined for dtype {name}; {hint}"


def supports(str dtype, str op) -> bool:
    """Whether allreduce defines `op` for elements of `dtype` (names as in KIND_NAMES)."""
    try:
        get_reduction(KIND_NAMES.index(dtype), op_code(op))
    except ValueError:
        return False
    return True


def half_precision_paths() -> dict:
    """How float16 and bfloat16 are reduced: the MPI's own datatype or fastreduce's op."""
    return dict(_half_paths)


cdef void _define(int kind, int op, MPI_Datatype datatype, MPI_Op mpi_op, int itemsize,
                  bint predefined) noexcept:
    _table[kind][op] = Reduction(datatype=datatype, op=mpi_op, itemsize=itemsize,
                                 divide_kind=-1, predefined=predefined, opcode=op,
                                 wire=FR_WIRE_NONE, wire_datatype=MPI_DATATYPE_NULL,
                                 wire_op=MPI_OP_NULL)


cdef void _set_kind(int kind, MPI_Datatype datatype, int itemsize, int divide_kind,
                    tuple ops) noexcept:
    """Predefined MPI ops on an MPI datatype; "avg" is the sum, divided afterwards."""
    for code in range(NOPS):
        _define(kind, code, datatype, MPI_OP_NULL, itemsize, True)
    for code in ops:
        _define(kind, code, datatype, _predefined(code), itemsize, True)
    if divide_kind >= 0:
        _table[kind][<int>OP_AVG] = _table[kind][<int>OP_SUM]
        _table[kind][<int>OP_AVG].divide_kind = divide_kind
        _table[kind][<int>OP_AVG].opcode = OP_SUM


cdef MPI_Op _predefined(int code) noexcept:
    if code == OP_SUM:
        return MPI_SUM
    if code == OP_PROD:
        return MPI_PROD
    if code == OP_MIN:
        return MPI_MIN
    if code == OP_MAX:
        return MPI_MAX
    if code == OP_BAND:
        return MPI_BAND
    if code == OP_BOR:
        return MPI_BOR
    if code == OP_BXOR:
        return MPI_BXOR
    return MPI_OP_NULL


cdef bint _mpi_reduces_half(MPI_Datatype datatype, MPI_Op op, bint is_bf16) noexcept:
    """Whether the MPI's own 16-bit float type gives right answers for `op` (asked, not assumed)."""
    cdef float a[2]
    cdef float b[2]
    cdef uint16_t x[2]
    cdef uint16_t y[2]
    a[:] = [1.5, -2.0]
    b[:] = [0.25, 3.0]
    cdef float expected[2]
    if op == MPI_SUM:
        expected[:] = [1.75, 1.0]
    elif op == MPI_PROD:
        expected[:] = [0.375, -6.0]
    elif op == MPI_MIN:
        expected[:] = [0.25, -2.0]
    else:
        expected[:] = [1.5, 3.0]
    cdef int j
    for j in range(2):
        x[j] = fr_f32_to_bf16(a[j]) if is_bf16 else fr_f32_to_f16(a[j])
        y[j] = fr_f32_to_bf16(b[j]) if is_bf16 else fr_f32_to_f16(b[j])
    if MPI_Reduce_local(x, y, 2, datatype, op) != MPI_SUCCESS:
        return False
    for j in range(2):
        if (fr_bf16_to_f32(y[j]) if is_bf16 else fr_f16_to_f32(y[j])) != expected[j]:
            return False
    return True


# fastreduce's own ops for the 16-bit floats (sum, prod, min, max), created once
cdef MPI_Op _own_ops[2][4]
cdef bint _own_made[2][4]  # zero-initialised: none made yet


cdef bint _may_probe_mpi_half_types(str setting) except -1:
    """Whether to ask the MPI if its own 16-bit float types reduce correctly.

    Only with FASTREDUCE_HALF_OPS=mpi: fastreduce's ops are the default ("auto")
    because they were measured 8-35x faster on host memory than Open MPI 5.0's
    MPIX_C_FLOAT16 sum (docs/usage.md), and MPICH builds without compiler
    support for a type abort the process in an assertion when asked.
    """
    return setting == "mpi"


cdef void _set_half_kind(int kind, MPI_Datatype mpix, str mpix_name, int divide_kind,
                         MPI_User_function* fsum, MPI_User_function* fprod,
                         MPI_User_function* fmin, MPI_User_function* fmax,
                         str setting) except *:
    cdef bint is_bf16 = kind == KIND_BFLOAT16
    cdef bint probe = mpix != MPI_DATATYPE_NULL and _may_probe_mpi_half_types(setting)
    cdef MPI_User_function* functions[4]
    functions[:] = [fsum, fprod, fmin, fmax]
    cdef int codes[4]
    codes[:] = [OP_SUM, OP_PROD, OP_MIN, OP_MAX]
    cdef int half = 1 if is_bf16 else 0
    _set_kind(kind, MPI_UINT16_T, 2, divide_kind, ())
    paths = []
    for i in range(4):
        if probe and _mpi_reduces_half(mpix, _predefined(codes[i]), is_bf16):
            _define(kind, codes[i], mpix, _predefined(codes[i]), 2, True)
            paths.append(f"{OP_NAMES[codes[i]]}: {mpix_name}")
        else:
            # a 2-byte integer type carries the bits; fastreduce's commutative
            # op combines them in float32 and rounds to nearest even
            if not _own_made[half][i]:
                CHKERR(MPI_Op_create(functions[i], 1, &_own_ops[half][i]))
                _own_made[half][i] = True
            _define(kind, codes[i], MPI_UINT16_T, _own_ops[half][i], 2, False)
            paths.append(f"{OP_NAMES[codes[i]]}: fastreduce op")
    _table[kind][<int>OP_AVG] = _table[kind][<int>OP_SUM]
    _table[kind][<int>OP_AVG].divide_kind = divide_kind
    _table[kind][<int>OP_AVG].opcode = OP_SUM
    _half_paths[KIND_NAMES[kind]] = ", ".join(paths)
    _set_compressed(FR_WIRE_BF16 if is_bf16 else FR_WIRE_F16, kind)


# float32 reductions sent as 16 bits: [wire - 1][op], made with the 16-bit kinds
cdef Reduction _compressed[2][NOPS]


cdef void _set_compressed(int wire, int half_kind) noexcept:
    cdef int code
    cdef int f32 = KIND_FLOAT32
    for code in range(NOPS):
        _compressed[wire - 1][code] = _table[f32][code]
        _compressed[wire - 1][code].wire = wire
        _compressed[wire - 1][code].wire_datatype = _table[half_kind][code].datatype
        _compressed[wire - 1][code].wire_op = _table[half_kind][code].op
        _compressed[wire - 1][code].predefined = False  # the 16-bit copy is fastreduce's


COMPRESSIONS = {None: FR_WIRE_NONE, "none": FR_WIRE_NONE, "bf16": FR_WIRE_BF16,
                "bfloat16": FR_WIRE_BF16, "fp16": FR_WIRE_F16, "float16": FR_WIRE_F16}


cdef int compression_code(object compression) except -1:
    """FR_WIRE_* of a compression name (None, "none", "bf16", "fp16")."""
    if compression is None:
        return FR_WIRE_NONE
    code = COMPRESSIONS.get(compression.lower() if isinstance(compression, str) else None)
    if code is None:
        raise ValueError(f"fastreduce: compression {compression!r}: use None, 'bf16' or "
                         f"'fp16' (float32 data sent as bfloat16 or float16)")
    return code


cdef const Reduction* get_compressed(const Reduction* red, int kind, int op,
                                     int wire) except NULL:
    """`red` sent over a 16-bit wire: float32 only (16-bit floats are sent as they are)."""
    if wire == FR_WIRE_NONE or kind == KIND_FLOAT16 or kind == KIND_BFLOAT16:
        return red
    if kind != KIND_FLOAT32:
        raise ValueError(f"fastreduce: compression applies to float32 data, not "
                         f"{KIND_NAMES[kind]}; pass compression=None for this tensor")
    return &_compressed[wire - 1][op]


cdef tuple _INT_OPS = (OP_SUM, OP_PROD, OP_MIN, OP_MAX, OP_BAND, OP_BOR, OP_BXOR)
cdef tuple _FLOAT_OPS = (OP_SUM, OP_PROD, OP_MIN, OP_MAX)
cdef tuple _COMPLEX_OPS = (OP_SUM, OP_PROD)


cdef void _init_tables() except *:
    _set_kind(KIND_INT8, MPI_INT8_T, 1, -1, _INT_OPS)
    _set_kind(KIND_INT16, MPI_INT16_T, 2, -1, _INT_OPS)
    _set_kind(KIND_INT32, MPI_INT32_T, 4, -1, _INT_OPS)
    _set_kind(KIND_INT64, MPI_INT64_T, 8, -1, _INT_OPS)
    _set_kind(KIND_UINT8, MPI_UINT8_T, 1, -1, _INT_OPS)
    _set_kind(KIND_UINT16, MPI_UINT16_T, 2, -1, _INT_OPS)
    _set_kind(KIND_UINT32, MPI_UINT32_T, 4, -1, _INT_OPS)
    _set_kind(KIND_UINT64, MPI_UINT64_T, 8, -1, _INT_OPS)
    _set_kind(KIND_FLOAT32, MPI_FLOAT, 4, FR_SCALE_F32, _FLOAT_OPS)
    _set_kind(KIND_FLOAT64, MPI_DOUBLE, 8, FR_SCALE_F64, _FLOAT_OPS)
    _set_kind(KIND_COMPLEX64, MPI_C_FLOAT_COMPLEX, 8, FR_SCALE_C64, _COMPLEX_OPS)
    _set_kind(KIND_COMPLEX128, MPI_C_DOUBLE_COMPLEX, 16, FR_SCALE_C128, _COMPLEX_OPS)
    # MPI defines only the logical ops on MPI_C_BOOL; on 0/1 values they are the
    # bitwise ones, and min/max are and/or.
    _set_kind(KIND_BOOL, MPI_C_BOOL, 1, -1, ())
    _define(KIND_BOOL, OP_BAND, MPI_C_BOOL, MPI_LAND, 1, True)
    _define(KIND_BOOL, OP_MIN, MPI_C_BOOL, MPI_LAND, 1, True)
    _define(KIND_BOOL, OP_BOR, MPI_C_BOOL, MPI_LOR, 1, True)
    _define(KIND_BOOL, OP_MAX, MPI_C_BOOL, MPI_LOR, 1, True)
    _define(KIND_BOOL, OP_BXOR, MPI_C_BOOL, MPI_LXOR, 1, True)
    _init_half_kinds("fastreduce")


cdef void _init_half_kinds(str setting) except *:
    _set_half_kind(KIND_FLOAT16, FR_MPIX_FLOAT16, "MPIX_C_FLOAT16", FR_SCALE_F16,
                   fr_f16_sum, fr_f16_prod, fr_f16_min, fr_f16_max, setting)
    _set_half_kind(KIND_BFLOAT16, FR_MPIX_BFLOAT16, "MPIX_BFLOAT16", FR_SCALE_BF16,
                   fr_bf16_sum, fr_bf16_prod, fr_bf16_min, fr_bf16_max, setting)


def mpi_half_types() -> dict:
    """Whether the MPI this extension was built against has its own float16 and bfloat16
    datatypes (what FASTREDUCE_HALF_OPS=mpi can ask)."""
    return {"float16": FR_MPIX_FLOAT16 != MPI_DATATYPE_NULL,
            "bfloat16": FR_MPIX_BFLOAT16 != MPI_DATATYPE_NULL}


def set_half_ops(str setting) -> None:
    """Whose ops the 16-bit floats use: "fastreduce" (also "auto") or "mpi" (the MPI's own
    types where asking it shows they reduce correctly). Set once, at set-up
    (FASTREDUCE_HALF_OPS), before any 16-bit all-reduce."""
    global _half_ops
    if setting not in ("auto", "mpi", "fastreduce"):
        raise ValueError(f"fastreduce: half ops {setting!r}: use auto, mpi or fastreduce")
    _init_half_kinds(setting)
    _half_ops = "mpi" if setting == "mpi" else "fastreduce"
    _forget_plans()  # the ranks agree on it again: it decides their datatypes


def half_ops() -> str:
    """Whose ops the 16-bit floats use: "fastreduce" or "mpi" (set_half_ops)."""
    return _half_ops


_half_ops = "fastreduce"


# fastreduce's own 16-bit ops until set-up hands down FASTREDUCE_HALF_OPS: they are right
# on every MPI, and asking an MPICH about its own types may abort the process
_init_tables()
