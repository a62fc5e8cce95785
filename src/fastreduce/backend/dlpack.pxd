# The DLPack ABI (v1.x) as far as fastreduce reads it: DLTensor, the managed
# tensors in the `__dlpack__()` capsules, and the C exchange API of DLPack 1.3
# (`type(x).__dlpack_c_exchange_api__`). Layouts follow dlpack.h.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef enum:
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLROCM = 10
    kDLROCMHost = 11
    kDLCUDAManaged = 13

cdef enum:
    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLOpaqueHandle = 3
    kDLBfloat = 4
    kDLComplex = 5
    kDLBool = 6

cdef enum:
    DLPACK_FLAG_BITMASK_READ_ONLY = 1
    DLPACK_FLAG_BITMASK_IS_COPIED = 2

ctypedef struct DLPackVersion:
    uint32_t major
    uint32_t minor

ctypedef struct DLDevice:
    int32_t device_type
    int32_t device_id

ctypedef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

ctypedef struct DLTensor:
    void* data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t* shape
    int64_t* strides
    uint64_t byte_offset

ctypedef struct DLManagedTensor:
    DLTensor dl_tensor
    void* manager_ctx
    void (*deleter)(DLManagedTensor*) noexcept nogil

ctypedef struct DLManagedTensorVersioned:
    DLPackVersion version
    void* manager_ctx
    void (*deleter)(DLManagedTensorVersioned*) noexcept nogil
    uint64_t flags
    DLTensor dl_tensor

ctypedef void (*DLPackSetError)(void*, const char*, const char*) noexcept
ctypedef int (*DLPackManagedTensorAllocator)(
    DLTensor*, DLManagedTensorVersioned**, void*, DLPackSetError) noexcept
ctypedef int (*DLPackManagedTensorFromPyObjectNoSync)(
    void*, DLManagedTensorVersioned**) noexcept
ctypedef int (*DLPackManagedTensorToPyObjectNoSync)(DLManagedTensorVersioned*, void**) except -1
ctypedef int (*DLPackDLTensorFromPyObjectNoSync)(void*, DLTensor*) except -1
ctypedef int (*DLPackCurrentWorkStream)(int32_t, int32_t, void**) noexcept

ctypedef struct DLPackExchangeAPIHeader:
    DLPackVersion version
    DLPackExchangeAPIHeader* prev_api

ctypedef struct DLPackExchangeAPI:
    DLPackExchangeAPIHeader header
    DLPackManagedTensorAllocator managed_tensor_allocator
    DLPackManagedTensorFromPyObjectNoSync managed_tensor_from_py_object_no_sync
    DLPackManagedTensorToPyObjectNoSync managed_tensor_to_py_object_no_sync
    DLPackDLTensorFromPyObjectNoSync dltensor_from_py_object_no_sync
    DLPackCurrentWorkStream current_work_stream
