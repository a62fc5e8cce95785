"""Tensor memory through DLPack: the C exchange API first, `__dlpack__()` otherwise."""

import sys

from .reductions import KIND_NAMES as _KIND_NAMES

from cpython.object cimport PyObject, PyTypeObject
from cpython.weakref cimport PyWeakref_NewRef
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.ref cimport Py_DECREF
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)

from .dlpack cimport (
    DLPACK_FLAG_BITMASK_IS_COPIED, DLPACK_FLAG_BITMASK_READ_ONLY, DLManagedTensor,
    DLManagedTensorVersioned, DLPackExchangeAPI, DLTensor, kDLComplex, kDLCPU, kDLCUDA,
    kDLCUDAHost, kDLCUDAManaged, kDLOpaqueHandle, kDLROCM, kDLROCMHost,
)
from .cudart cimport consumer_stream, require_device
from .dtypes cimport kind_from_dlpack

cdef extern from "Python.h":
    PyTypeObject* Py_TYPE(object)
    PyObject* PyWeakref_GET_OBJECT(PyObject* ref)  # borrowed; no error

cdef extern from "hostpool.h" nogil:
    enum: FR_POOL_MIN_BYTES
    void* fr_pool_take(size_t nbytes, size_t* size)
    void fr_pool_give(void* ptr, size_t size)
    size_t fr_pool_set_limit(size_t limit)
    size_t fr_pool_cached
    size_t fr_pool_limit
    uint64_t fr_pool_hits
    uint64_t fr_pool_misses

ctypedef struct PooledTensor:
    DLManagedTensorVersioned managed  # first: the deleter casts back to PooledTensor
    size_t block_size                 # a cached block's size; 0: data follows the header
    # followed by ndim shape and ndim strides (int64_t), then, for small results, the data

# What each type seen so far is: (its exchange API as a number, 0 for none; TYPE_*; the
# refusal's message for TYPE_REFUSED). The dict holds the types, so the one-entry cache's
# raw type pointer cannot dangle.
cdef enum:
    TYPE_OTHER = 0    # not torch: DLPack says all there is
    TYPE_TORCH = 1    # torch.Tensor, Parameter, subclasses without __torch_dispatch__
    TYPE_REFUSED = 2  # a torch subclass with __torch_dispatch__: memory need not hold values

cdef dict _type_info = {}
cdef PyTypeObject* _last_type = NULL
cdef const DLPackExchangeAPI* _last_api = NULL
cdef int _last_kind = TYPE_OTHER
cdef dict _empty_like_by_type = {}

cdef dict _DEVICE_NAMES = {
    kDLCPU: "cpu", kDLCUDA: "cuda", kDLCUDAHost: "cpu (CUDA pinned)",
    kDLCUDAManaged: "cuda (managed)", kDLROCM: "rocm", kDLROCMHost: "cpu (ROCm pinned)",
}


cdef str device_name(int device_type, int device_id):
    """'cpu', 'cuda:1', ...: a DLPack device as users write it."""
    if device_type == kDLCPU or device_type == kDLCUDAHost or device_type == kDLROCMHost:
        return _DEVICE_NAMES[device_type]  # host memory: no device number
    return f"{_DEVICE_NAMES.get(device_type, f'DLPack device type {device_type}')}:{device_id}"


cdef tuple _describe_type(object tp):
    """(exchange API as a number or 0, TYPE_*, refusal message or None) for a type."""
    cached = _type_info.get(tp)
    if cached is not None:
        return cached
    api_number = 0
    capsule = getattr(tp, "__dlpack_c_exchange_api__", None)
    if capsule is not None and PyCapsule_IsValid(capsule, b"dlpack_exchange_api"):
        api = <const DLPackExchangeAPI*>PyCapsule_GetPointer(capsule, b"dlpack_exchange_api")
        if api.header.version.major == 1 and api.dltensor_from_py_object_no_sync != NULL:
            api_number = <size_t>api
    kind, refusal = _torch_kind(tp)
    cached = (api_number, kind, refusal)
    _type_info[tp] = cached
    return cached


def _uses_exchange_api(obj) -> bool:
    """Whether fastreduce reads `obj` through the DLPack C exchange API (the fast path)."""
    return _describe_type(type(obj))[0] != 0


cdef inline int _look_up_type(PyTypeObject* tp) except -1:
    global _last_type, _last_api, _last_kind
    if tp != _last_type:
        api_number, kind, _ = _describe_type(<object>tp)
        _last_api = <const DLPackExchangeAPI*><size_t>api_number
        _last_kind = kind
        _last_type = tp
    return 0


cdef object acquire(object obj, BufferView* view, bint writable, str role):
    """Fill `view` from any DLPack producer; returns what must stay alive while it is used.

    A torch lazy view (conjugate or negative bit) is read through a resolved copy: `view`
    then describes the copy, view.lazy says so, and the owner returned is a Resolved
    holding the copy (its write_back() stores a result into the view, for in-place calls).
    """
    cdef DLTensor dl
    _look_up_type(Py_TYPE(obj))
    cdef int kind = _last_kind
    cdef const DLPackExchangeAPI* api = _last_api
    if kind == TYPE_REFUSED:
        raise TypeError(_type_info[type(obj)][2].format(role=role))
    if api != NULL:
        try:
            api.dltensor_from_py_object_no_sync(<void*>obj, &dl)
        except Exception as exc:  # torch's reason (sparse, nested, meta, ...) in our words
            raise _unreadable(obj, role, exc) from None
        _fill_view(&dl, view, 0, writable, role)
        view.api = api
        if kind == TYPE_TORCH:
            view.torch = True
            if not _known_plain(obj):
                _check_lazy(obj, view)
                if view.lazy:
                    return _read_resolved(obj, view, writable, role)
        if view.on_device:
            _producer_stream(view, role)
        return None
    if kind == TYPE_TORCH and not _known_plain(obj):
        view.dtype.code = kDLOpaqueHandle  # not read yet: ask for both bits
        _check_lazy(obj, view)
        if view.lazy:
            return _read_resolved(obj, view, writable, role)
    owner = _acquire_from_capsule(obj, view, writable, role)
    view.torch = kind == TYPE_TORCH
    return owner


# --- torch's lazy views and tensor subclasses --------------------------------------------
#
# torch can give a tensor whose memory is not its values: conj() of a complex tensor sets
# the conjugate bit (memory holds the conjugates), .imag of such a view and _neg_view()
# the negative bit (memory holds the negations). DLPack's C exchange API hands over the
# memory as it is. Asking torch costs about 0.15 us a call here, so tensors found plain
# are remembered (by weak reference: a new tensor at a freed one's address is not mistaken
# for it) in a small table, and a tensor passed again costs a pointer comparison.

cdef enum:
    PLAIN_SLOTS = 64  # a power of two

cdef void* _plain_keys[PLAIN_SLOTS]
cdef list _plain_refs = [None] * PLAIN_SLOTS
cdef object _is_conj = None  # torch.Tensor.is_conj, is_neg: set with the first torch type
cdef object _is_neg = None


cdef inline bint _known_plain(object obj) noexcept:
    cdef size_t slot = (<size_t><void*>obj >> 4) & (PLAIN_SLOTS - 1)
    if _plain_keys[slot] != <void*>obj:
        return False
    return <void*>PyWeakref_GET_OBJECT(<PyObject*>_plain_refs[slot]) == <void*>obj


cdef int _check_lazy(object obj, BufferView* view) except -1:
    """Set view.lazy from torch's bits; remember a plain tensor."""
    cdef int bits = 0
    if (view.dtype.code == kDLComplex or view.dtype.code == kDLOpaqueHandle) and _is_conj(obj):
        bits |= LAZY_CONJ
    if _is_neg(obj):
        bits |= LAZY_NEG
    view.lazy = bits
    cdef size_t slot
    if bits == 0:
        try:
            ref = PyWeakref_NewRef(obj, None)
        except TypeError:  # a type without weak references: asked every time
            return 0
        slot = (<size_t><void*>obj >> 4) & (PLAIN_SLOTS - 1)
        _plain_refs[slot] = ref
        _plain_keys[slot] = <void*>obj
    return 0


cdef class Resolved:
    """A lazy view's values resolved into a copy, written back into the view on request."""

    def __cinit__(self, view, copy):
        self.view = view
        self.copy = copy

    cdef int write_back(self) except -1:
        """Store the copy's values into the view (torch applies the view's bits)."""
        self.view.copy_(self.copy)
        return 0


cdef object _read_resolved(object obj, BufferView* view, bint writable, str role):
    """Read a lazy view through a resolved copy of its values (see acquire)."""
    cdef int bits = view.lazy
    resolved = Resolved(obj, obj.resolve_conj().resolve_neg())
    acquire(resolved.copy, view, writable, role)  # torch: the copy is its own owner
    view.lazy = bits
    return resolved


cdef tuple _torch_kind(object tp):
    """(TYPE_*, refusal message) for a type: torch tensors are recognised by their base
    class, without importing torch."""
    global _is_conj, _is_neg
    base = None
    for cls in getattr(tp, "__mro__", ()):
        if cls.__module__ == "torch" and cls.__qualname__ == "Tensor":
            base = cls
            break
    if base is None:
        return TYPE_OTHER, None
    _is_conj, _is_neg = base.is_conj, base.is_neg
    dispatches = False
    for cls in tp.__mro__:
        if cls not in base.__mro__ and "__torch_dispatch__" in vars(cls):
            dispatches = True
    if not dispatches:
        return TYPE_TORCH, None
    name = tp.__qualname__
    if "FakeTensor" in name or "FunctionalTensor" in name:
        fix = ("it stands for a tensor while torch.compile (or a FakeTensorMode) traces and "
               "has no data; in compiled code call fastreduce.ops.allreduce / allreduce_ or "
               "the fastreduce.nn layers, which torch.compile traces as custom ops")
    elif name == "DTensor":
        fix = ("reduce its local shard explicitly (fastreduce.allreduce_(x.to_local())) or "
               "let DTensor redistribute it")
    else:
        fix = ("a subclass with __torch_dispatch__ computes its values, so its memory need "
               "not hold them; pass a plain tensor")
    return TYPE_REFUSED, f"fastreduce: {{role}} is a {tp.__module__}.{name}: {fix}"


cdef object _unreadable(object obj, str role, object exc):
    """The exception for a tensor torch could not hand over through DLPack."""
    if getattr(obj, "is_nested", False):
        return TypeError(f"fastreduce: {role} is a nested tensor, which has no single dense "
                         f"memory; reduce its components (x.unbind()) or, for the jagged "
                         f"layout, x.values()")
    layout = getattr(obj, "layout", None)
    if layout is not None and str(layout) != "torch.strided":
        return TypeError(f"fastreduce: {role} has layout {layout}; fastreduce reduces dense "
                         f"tensors: reduce x.to_dense(), or the values of a sparse tensor "
                         f"whose indices are the same on every rank")
    if getattr(obj, "is_quantized", False):
        return TypeError(f"fastreduce: {role} is quantized ({obj.dtype}); reduce "
                         f"x.dequantize() (or x.int_repr() with an op that suits it)")
    device = getattr(obj, "device", None)
    if device is not None and getattr(device, "type", "cpu") not in ("cpu", "cuda"):
        return TypeError(f"fastreduce: {role} lives on {device}, which has "
                         f"{'no data' if device.type == 'meta' else 'no memory MPI can read'}"
                         f"; fastreduce reduces host and CUDA memory")
    return BufferError(f"fastreduce: {role} cannot be read through DLPack: {exc}")


cdef int _producer_stream(BufferView* view, str role) except -1:
    """The framework's current work stream for view's device (exchange API producers)."""
    require_device(view.device_type, view.device_id, role)
    view.stream = NULL  # the legacy default stream, if the framework names none
    if view.api.current_work_stream != NULL:
        if view.api.current_work_stream(kDLCUDA, view.device_id, &view.stream) != 0:
            raise RuntimeError(f"fastreduce: the framework of {role} could not say its "
                               f"current CUDA stream on cuda:{view.device_id}")
    return 0


cdef object _export_stream(object obj, str role):
    """The stream argument for obj.__dlpack__: fastreduce's own stream on a CUDA device.

    The producer makes its pending work visible on that stream (DLPack's stream
    semantics); fastreduce then works on it and finishes before returning.
    """
    try:
        device_of = obj.__dlpack_device__
    except AttributeError:
        return None
    device = device_of()
    device_type, device_id = int(device[0]), int(device[1])
    if device_type != kDLCUDA and device_type != kDLCUDAManaged:
        return None
    require_device(device_type, device_id, role)
    return <size_t>consumer_stream(device_id)


cdef object _acquire_from_capsule(object obj, BufferView* view, bint writable, str role):
    try:
        export = obj.__dlpack__
    except AttributeError:
        raise TypeError(
            f"fastreduce: {role} of type {type(obj).__module__}.{type(obj).__qualname__} does "
            f"not support DLPack (no __dlpack__ method); pass a torch tensor, a numpy array "
            f"or another DLPack producer") from None
    if getattr(obj, "requires_grad", False):
        # torch's __dlpack__ refuses a tensor that requires grad; its detached view
        # shares the memory (the C exchange API, where torch has it, never asks)
        obj = obj.detach()
        export = obj.__dlpack__
    stream = _export_stream(obj, role)
    try:
        try:
            if stream is None:
                capsule = export(max_version=(1, 3))
            else:
                capsule = export(stream=stream, max_version=(1, 3))
        except TypeError:
            # a producer older than DLPack 1.0
            capsule = export() if stream is None else export(stream=stream)
    except BufferError as exc:  # the producer's refusal, with what to do about it
        raise BufferError(f"fastreduce: {role} cannot be exported through DLPack: "
                          f"{exc}{_export_hint(obj)}") from None
    cdef DLManagedTensorVersioned* versioned
    cdef DLManagedTensor* legacy
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        versioned = <DLManagedTensorVersioned*>PyCapsule_GetPointer(
            capsule, b"dltensor_versioned")
        if versioned.version.major != 1:
            raise BufferError(
                f"fastreduce: {role} was exported with DLPack {versioned.version.major}."
                f"{versioned.version.minor}; this fastreduce reads DLPack 1.x")
        _fill_view(&versioned.dl_tensor, view, versioned.flags, writable, role)
    elif PyCapsule_IsValid(capsule, b"dltensor"):
        legacy = <DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        _fill_view(&legacy.dl_tensor, view, 0, writable, role)
    else:
        raise TypeError(
            f"fastreduce: {role}.__dlpack__() returned {type(capsule).__name__}, "
            f"not an unconsumed DLPack capsule")
    view.api = NULL
    if view.on_device:
        if stream is None:  # exported for the legacy default stream
            require_device(view.device_type, view.device_id, role)
        view.stream = <void*><size_t>(stream or 0)
        view.own_stream = True
    # The capsule still carries its name, so when it is released its destructor
    # calls the producer's deleter, as the DLPack protocol prescribes.
    return capsule


cdef str _export_hint(object obj):
    dtype = getattr(obj, "dtype", None)
    if getattr(dtype, "byteorder", "=") not in ("=", "|"):
        return "; convert it to this machine's byte order: x.astype(x.dtype.newbyteorder('='))"
    return ""


cdef int _fill_view(const DLTensor* dl, BufferView* view, uint64_t flags, bint writable,
                    str role) except -1:
    cdef int kind = kind_from_dlpack(dl.dtype.code, dl.dtype.bits, dl.dtype.lanes)
    if kind < 0:
        raise TypeError(f"fastreduce: {role} has dtype {_dtype_name(dl)}, which fastreduce "
                        f"does not reduce; convert it (e.g. .to(torch.float32))")
    cdef int device = dl.device.device_type
    if (device != kDLCPU and device != kDLCUDAHost and device != kDLROCMHost
            and device != kDLCUDA and device != kDLCUDAManaged):
        raise TypeError(
            f"fastreduce: {role} lives on {device_name(device, dl.device.device_id)}; "
            f"fastreduce reduces host and CUDA memory: move it with .cpu() (or .to('cpu')) "
            f"first")
    cdef int64_t expected = 1
    cdef bint contiguous = True
    cdef int i
    for i in range(dl.ndim - 1, -1, -1):
        # size-1 dimensions may carry any stride; NULL strides mean row-major
        if dl.strides != NULL and dl.shape[i] != 1 and dl.strides[i] != expected:
            contiguous = False
        expected *= dl.shape[i]
    if not contiguous and expected != 0:
        raise BufferError(
            f"fastreduce: {role} is not contiguous (shape {_shape(dl)}, strides "
            f"{[dl.strides[i] for i in range(dl.ndim)]}); call .contiguous() "
            f"(numpy: np.ascontiguousarray) first")
    if writable and flags & DLPACK_FLAG_BITMASK_READ_ONLY:
        raise BufferError(f"fastreduce: {role} is read-only; pass a writable array "
                          f"(numpy: a copy, or arr.flags.writeable = True where allowed)")
    if writable and flags & DLPACK_FLAG_BITMASK_IS_COPIED:
        raise BufferError(f"fastreduce: {role} was exported as a copy, so results written "
                          f"to it would be lost; pass a tensor whose memory can be shared")
    if dl.data == NULL and expected != 0:
        raise BufferError(
            f"fastreduce: {role} has no memory (its DLPack data pointer is NULL): a tensor "
            f"that only stands for values (a functional or fake tensor, as torch.compile "
            f"makes); pass a tensor that holds its values")
    view.data = <char*>dl.data + dl.byte_offset
    view.count = expected
    view.kind = kind
    view.dtype = dl.dtype
    view.ndim = dl.ndim
    view.shape = dl.shape
    view.device_type = dl.device.device_type
    view.device_id = dl.device.device_id
    view.on_device = device == kDLCUDA or device == kDLCUDAManaged
    view.stream = NULL
    view.own_stream = False
    view.torch = False
    view.lazy = 0
    return 0


cdef dict _DLPACK_CODE_NAMES = {
    0: "int", 1: "uint", 2: "float", 3: "opaque", 4: "bfloat", 5: "complex", 6: "bool",
}
# codes whose name says the width (DLPack 1.1+)
cdef dict _DLPACK_NARROW_FLOATS = {
    7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
    11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
    15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn",
}


cdef str _dtype_name(const DLTensor* dl):
    code = dl.dtype.code
    if code in _DLPACK_NARROW_FLOATS:
        name = _DLPACK_NARROW_FLOATS[code]
    else:
        name = f"{_DLPACK_CODE_NAMES.get(code, f'<DLPack type code {code}>')}{dl.dtype.bits}"
    return name if dl.dtype.lanes == 1 else f"{name}x{dl.dtype.lanes}"


cdef list _shape(const DLTensor* dl):
    return [dl.shape[i] for i in range(dl.ndim)]


cdef void _collect_error(void* ctx, const char* kind, const char* message) noexcept with gil:
    (<list>ctx).append(f"{kind.decode(errors='replace')}: {message.decode(errors='replace')}")


cdef void _give_back_block(DLManagedTensorVersioned* managed) noexcept nogil:
    cdef PooledTensor* ctx = <PooledTensor*>managed
    if ctx.block_size:
        fr_pool_give(managed.dl_tensor.data, ctx.block_size)
    free(ctx)


cdef void _fill_result_view(BufferView* view, BufferView* out, char* data,
                            const DLPackExchangeAPI* api) noexcept:
    out[0] = view[0]
    out.data = data
    out.api = api


cdef object _host_result(BufferView* view, const DLPackExchangeAPI* api, BufferView* out):
    """A new framework tensor over memory of ours, handed over through DLPack.

    Small results share one 64-byte-aligned allocation with their descriptor (one
    malloc, cheaper than the framework's own allocator path); results of
    FR_POOL_MIN_BYTES and more take a cached page-aligned block (see _hostpool.h).
    """
    cdef int ndim = view.ndim
    cdef size_t nbytes = view.count * (view.dtype.bits // 8)
    cdef size_t header = (sizeof(PooledTensor) + 2 * ndim * sizeof(int64_t) + 63) // 64 * 64
    cdef bint small = nbytes < FR_POOL_MIN_BYTES
    cdef void* memory = NULL
    if posix_memalign(&memory, 64, header + nbytes if small else header) != 0:
        raise MemoryError(f"fastreduce: could not allocate a {nbytes}-byte result")
    cdef PooledTensor* ctx = <PooledTensor*>memory
    cdef void* data
    if small:
        ctx.block_size = 0
        data = <char*>memory + header
    else:
        data = fr_pool_take(nbytes, &ctx.block_size)
        if data == NULL:
            free(ctx)
            raise MemoryError(f"fastreduce: could not allocate a {nbytes}-byte result")
    cdef int64_t* shape = <int64_t*>(ctx + 1)
    cdef int64_t* strides = shape + ndim
    cdef int64_t stride = 1
    cdef int i
    for i in range(ndim - 1, -1, -1):
        shape[i] = view.shape[i]
        strides[i] = stride
        stride *= view.shape[i]
    cdef DLManagedTensorVersioned* managed = &ctx.managed
    managed.version.major = 1
    managed.version.minor = 0
    managed.manager_ctx = ctx
    managed.deleter = _give_back_block
    managed.flags = 0
    managed.dl_tensor.data = data
    managed.dl_tensor.device.device_type = view.device_type
    managed.dl_tensor.device.device_id = view.device_id
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = view.dtype
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    managed.dl_tensor.byte_offset = 0
    _fill_result_view(view, out, <char*>data, api)
    cdef void* result = NULL
    api.managed_tensor_to_py_object_no_sync(managed, &result)  # takes ownership
    new = <object>result
    Py_DECREF(new)  # <object> took a second reference
    return new


cdef object new_like(object obj, BufferView* view, BufferView* out):
    """A new, uninitialised object of obj's type, dtype, device and shape; fills `out`."""
    cdef const DLPackExchangeAPI* api = view.api
    cdef DLTensor proto
    cdef DLManagedTensorVersioned* managed = NULL
    cdef void* result = NULL
    if api != NULL and api.managed_tensor_to_py_object_no_sync != NULL:
        if view.device_type == kDLCPU:
            return _host_result(view, api, out)
        if api.managed_tensor_allocator != NULL:
            proto.data = NULL
            proto.device.device_type = view.device_type
            proto.device.device_id = view.device_id
            proto.ndim = view.ndim
            proto.dtype = view.dtype
            proto.shape = <int64_t*>view.shape
            proto.strides = NULL
            proto.byte_offset = 0
            errors = []
            if (api.managed_tensor_allocator(&proto, &managed, <void*>errors, _collect_error)
                    != 0 or managed == NULL):
                raise MemoryError(
                    f"fastreduce: could not allocate the result: {'; '.join(errors)}")
            _fill_result_view(view, out, <char*>managed.dl_tensor.data
                              + managed.dl_tensor.byte_offset, api)
            api.managed_tensor_to_py_object_no_sync(managed, &result)  # takes ownership
            new = <object>result
            Py_DECREF(new)  # <object> took a second reference
            return new
    empty_like = _empty_like_by_type.get(type(obj))
    if empty_like is None:
        module = sys.modules.get(type(obj).__module__.partition(".")[0])
        empty_like = getattr(module, "empty_like", None)
        if empty_like is None:
            raise TypeError(
                f"fastreduce: cannot allocate a result of type {type(obj).__qualname__}; "
                f"pass out= or use the in-place allreduce_")
        _empty_like_by_type[type(obj)] = empty_like
    new = empty_like(obj)
    # `new` owns its memory (a copying export is refused for writing), so the
    # export capsule need not outlive this call.
    acquire(new, out, True, "the result")
    check_same_layout(view, out)
    return new


cdef int check_same_layout(BufferView* x, BufferView* out) except -1:
    """Raise unless `out` can hold a result for `x`: same dtype, shape and device."""
    if out.kind != x.kind or out.dtype.bits != x.dtype.bits:
        raise ValueError(f"fastreduce: out has dtype {_view_dtype(out)} but x has "
                         f"{_view_dtype(x)}; pass an out of the same dtype")
    cdef bint same_shape = out.ndim == x.ndim
    cdef int i
    if same_shape:
        for i in range(x.ndim):
            if out.shape[i] != x.shape[i]:
                same_shape = False
    if not same_shape:
        raise ValueError(
            f"fastreduce: out has shape {[out.shape[i] for i in range(out.ndim)]} but x has "
            f"{[x.shape[i] for i in range(x.ndim)]}; pass an out of the same shape")
    if out.device_type != x.device_type or out.device_id != x.device_id:
        raise ValueError(
            f"fastreduce: out is on {device_name(out.device_type, out.device_id)} but x is on "
            f"{device_name(x.device_type, x.device_id)}; pass an out on x's device")
    return 0


cdef str _view_dtype(BufferView* v):
    return _KIND_NAMES[v.kind]


def check_readable(x, role="x") -> None:
    """Raise the error fastreduce gives for x when it cannot be reduced (type, layout,
    device, dtype, strides); nothing when it can."""
    cdef BufferView view
    acquire(x, &view, False, role)


def set_result_cache_limit(size_t nbytes) -> int:
    """Keep at most `nbytes` of freed out-of-place results for reuse (0: none); return the old."""
    return fr_pool_set_limit(nbytes)


def result_cache_info() -> dict:
    """The out-of-place result cache: limit, bytes cached now, hits and misses."""
    return {"limit": fr_pool_limit, "cached": fr_pool_cached, "hits": fr_pool_hits,
            "misses": fr_pool_misses, "min_result_bytes": FR_POOL_MIN_BYTES}
