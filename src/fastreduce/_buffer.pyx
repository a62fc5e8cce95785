"""Tensor memory through DLPack: the C exchange API first, `__dlpack__()` otherwise."""

import sys

from cpython.object cimport PyTypeObject
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.ref cimport Py_DECREF
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)

from ._dlpack cimport (
    DLPACK_FLAG_BITMASK_IS_COPIED, DLPACK_FLAG_BITMASK_READ_ONLY, DLManagedTensor,
    DLManagedTensorVersioned, DLPackExchangeAPI, DLTensor, kDLCPU, kDLCUDA, kDLCUDAHost,
    kDLCUDAManaged, kDLROCM, kDLROCMHost,
)
from ._cuda cimport consumer_stream, require_device
from ._dtypes cimport kind_from_dlpack

cdef extern from "Python.h":
    PyTypeObject* Py_TYPE(object)

cdef extern from "_hostpool.h" nogil:
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

# The exchange API of each type seen so far (0: none). The dict holds the types,
# so the one-entry cache's raw type pointer cannot dangle.
cdef dict _api_by_type = {}
cdef PyTypeObject* _last_type = NULL
cdef const DLPackExchangeAPI* _last_api = NULL
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


cdef const DLPackExchangeAPI* _lookup_api(object tp) except? NULL:
    cached = _api_by_type.get(tp)
    if cached is None:
        cached = 0
        capsule = getattr(tp, "__dlpack_c_exchange_api__", None)
        if capsule is not None and PyCapsule_IsValid(capsule, b"dlpack_exchange_api"):
            api = <const DLPackExchangeAPI*>PyCapsule_GetPointer(capsule, b"dlpack_exchange_api")
            if api.header.version.major == 1 and api.dltensor_from_py_object_no_sync != NULL:
                cached = <size_t>api
        _api_by_type[tp] = cached
    return <const DLPackExchangeAPI*><size_t>cached


def _uses_exchange_api(obj) -> bool:
    """Whether fastreduce reads `obj` through the DLPack C exchange API (the fast path)."""
    return _lookup_api(type(obj)) != NULL


cdef object acquire(object obj, BufferView* view, bint writable, str role):
    """Fill `view` from any DLPack producer; returns what must stay alive while it is used."""
    global _last_type, _last_api
    cdef DLTensor dl
    cdef PyTypeObject* tp = Py_TYPE(obj)
    if tp != _last_type:
        _last_api = _lookup_api(<object>tp)
        _last_type = tp
    cdef const DLPackExchangeAPI* api = _last_api
    if api != NULL:
        api.dltensor_from_py_object_no_sync(<void*>obj, &dl)
        _fill_view(&dl, view, 0, writable, role)
        view.api = api
        if view.on_device:
            _producer_stream(view, role)
        return None
    return _acquire_from_capsule(obj, view, writable, role)


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
    stream = _export_stream(obj, role)
    try:
        if stream is None:
            capsule = export(max_version=(1, 3))
        else:
            capsule = export(stream=stream, max_version=(1, 3))
    except TypeError:
        # a producer older than DLPack 1.0
        capsule = export() if stream is None else export(stream=stream)
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
    from ._ops import KIND_NAMES
    return KIND_NAMES[v.kind]


def set_result_cache_limit(size_t nbytes) -> int:
    """Keep at most `nbytes` of freed out-of-place results for reuse (0: none); return the old."""
    return fr_pool_set_limit(nbytes)


def result_cache_info() -> dict:
    """The out-of-place result cache: limit, bytes cached now, hits and misses."""
    return {"limit": fr_pool_limit, "cached": fr_pool_cached, "hits": fr_pool_hits,
            "misses": fr_pool_misses, "min_result_bytes": FR_POOL_MIN_BYTES}


def _init_cache_limit():
    import os
    setting = os.environ.get("FASTREDUCE_RESULT_CACHE_MB")
    if setting is not None:
        try:
            megabytes = float(setting)
        except ValueError:
            raise ValueError(f"FASTREDUCE_RESULT_CACHE_MB={setting!r}: give a number of MiB")
        fr_pool_set_limit(<size_t>(megabytes * (1 << 20)))


_init_cache_limit()
