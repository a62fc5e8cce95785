"""The CUDA runtime, loaded on first use of a GPU tensor: streams, copies, pinned staging.

fastreduce has no build-time dependency on CUDA. The first CUDA tensor makes this
module find libcudart (the one already in the process, e.g. torch's or cupy's,
first) and resolve the dozen functions it needs; machines without CUDA never get
here. Every copy and every host wait goes through this module, where it is counted
(copy_counts; with the path each call took: fastreduce.gpupaths.gpu_copy_counts), so tests
can prove which path moved which bytes.
"""

import os
import sys

from libc.math cimport sqrt
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free

from .dlpack cimport kDLCUDA

from .algochoice import forget as _forget_plans

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* filename, int flags)
    void* dlsym(void* handle, const char* symbol)
    char* dlerror()
    enum:
        RTLD_NOW
        RTLD_LOCAL
        RTLD_NOLOAD

cdef enum:
    cudaSuccess = 0
    cudaStreamNonBlocking = 1      # no implicit ordering with the legacy default stream
    cudaEventDisableTiming = 2
    cudaHostAllocPortable = 1      # pinned for every device and context
    MAX_DEVICES = 64
    PIPELINE_MIN_BYTES = 512 << 10
    CHUNK_MIN_BYTES = 256 << 10
    CHUNK_MAX_BYTES = 16 << 20
    CHUNK_ALIGN = 4096             # a multiple of every element size
    MOVE_WHOLE_MAX_BYTES = 8 << 20  # broadcast, all-gather, gather, all-to-all: whole to here

# The runtime's entry points; NULL until load_runtime() has succeeded.
cdef int (*_GetDevice)(int*) noexcept nogil
cdef int (*_StreamCreateWithFlags)(cudaStream_t*, unsigned) noexcept nogil
cdef int (*_StreamSynchronize)(cudaStream_t) noexcept nogil
cdef int (*_StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned) noexcept nogil
cdef int (*_EventCreateWithFlags)(cudaEvent_t*, unsigned) noexcept nogil
cdef int (*_EventRecord)(cudaEvent_t, cudaStream_t) noexcept nogil
cdef int (*_EventSynchronize)(cudaEvent_t) noexcept nogil
cdef int (*_MemcpyAsync)(void*, const void*, size_t, int, cudaStream_t) noexcept nogil
cdef int (*_HostAlloc)(void**, size_t, unsigned) noexcept nogil
cdef int (*_FreeHost)(void*) noexcept nogil
cdef const char* (*_GetErrorString)(int) noexcept nogil
cdef int (*_RuntimeGetVersion)(int*) noexcept nogil
cdef int (*_StreamIsCapturing)(cudaStream_t, int*) noexcept nogil
cdef int (*_Malloc)(void**, size_t) noexcept nogil
cdef int (*_Free)(void*) noexcept nogil
cdef int (*_Memset)(void*, int, size_t) noexcept nogil
cdef int (*_GetDeviceCount)(int*) noexcept nogil
cdef int (*_SetDevice)(int) noexcept nogil

cdef void* _library = NULL
cdef str _library_path = None
cdef bint _skip_waits = False      # tests only: proves the ordering tests can fail
cdef int64_t _fixed_chunk = 0      # FASTREDUCE_STAGING_CHUNK_KB (handed down), or tests
cdef cudaStream_t _consumer_streams[MAX_DEVICES]
cdef Staging* _free_contexts[MAX_DEVICES]

# copy_counts(): what went through this module since the last reset
cdef uint64_t _d2h_copies = 0
cdef uint64_t _h2d_copies = 0
cdef uint64_t _d2h_bytes = 0
cdef uint64_t _h2d_bytes = 0
cdef uint64_t _stream_syncs = 0
cdef uint64_t _event_syncs = 0
cdef uint64_t _pinned_allocs = 0
cdef uint64_t _pinned_bytes = 0

_SYMBOLS = (
    "cudaGetDevice", "cudaStreamCreateWithFlags", "cudaStreamSynchronize",
    "cudaStreamWaitEvent", "cudaEventCreateWithFlags", "cudaEventRecord",
    "cudaEventSynchronize", "cudaMemcpyAsync", "cudaHostAlloc", "cudaFreeHost",
    "cudaGetErrorString", "cudaRuntimeGetVersion", "cudaStreamIsCapturing", "cudaMalloc",
    "cudaFree", "cudaMemset", "cudaGetDeviceCount", "cudaSetDevice",
)
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


_library_setting = None  # set-up's callable: the path FASTREDUCE_CUDART names, or None


def set_library_source(source) -> None:
    """Ask `source()` for the CUDA runtime to load (FASTREDUCE_CUDART; None: search) each
    time it is looked for; None: always search."""
    global _library_setting
    _library_setting = source


def _candidates():
    """(path, only if already loaded) in search order; FASTREDUCE_CUDART overrides all."""
    explicit = None if _library_setting is None else _library_setting()
    if explicit:
        return [(explicit, False)]
    found = [(name, True) for name in _SONAMES]     # torch's or cupy's, already in process
    found += [(name, False) for name in _SONAMES]   # the loader's search path
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    dirs = [os.path.join(r, "lib64") for r in roots if r]
    for entry in sys.path:                          # pip's nvidia-cuda-runtime wheels
        dirs += [os.path.join(entry, "nvidia", "cuda_runtime", "lib"),
                 os.path.join(entry, "nvidia", "cu13", "lib")]
    for folder in dirs:
        for name in _SONAMES:
            path = os.path.join(folder, name)
            if os.path.exists(path):
                found.append((path, False))
    return found


cdef int load_runtime(str role, int device_id) except -1:
    """Load libcudart once; RuntimeError naming the device and the fix if it cannot be."""
    global _library, _library_path
    if _library != NULL:
        return 0
    cdef void* handle = NULL
    tried = []
    path = None
    for path, only_loaded in _candidates():
        handle = dlopen(path.encode(), RTLD_NOW | RTLD_LOCAL | (RTLD_NOLOAD if only_loaded else 0))
        if handle != NULL:
            break
        if not only_loaded:
            error = dlerror()
            tried.append(f"{path}: {error.decode(errors='replace') if error else 'not found'}")
    if handle == NULL:
        raise RuntimeError(
            f"fastreduce: {role} is on cuda:{device_id}, but no CUDA runtime library could be "
            f"loaded ({'; '.join(tried) or 'nothing found'}); install one (e.g. pip install "
            f"nvidia-cuda-runtime-cu12) or set FASTREDUCE_CUDART=/path/to/libcudart.so")
    cdef void* symbols[18]
    assert len(_SYMBOLS) == 18
    for i, name in enumerate(_SYMBOLS):
        symbols[i] = dlsym(handle, name.encode())
        if symbols[i] == NULL:
            raise RuntimeError(f"fastreduce: {path} has no {name}; point FASTREDUCE_CUDART "
                               f"at a CUDA runtime library (libcudart.so, CUDA 11 or newer)")
    global _GetDevice, _StreamCreateWithFlags, _StreamSynchronize, _StreamWaitEvent
    global _EventCreateWithFlags, _EventRecord, _EventSynchronize, _MemcpyAsync
    global _HostAlloc, _FreeHost, _GetErrorString, _RuntimeGetVersion, _StreamIsCapturing
    global _Malloc, _Free, _Memset, _GetDeviceCount, _SetDevice
    _GetDevice = <int (*)(int*) noexcept nogil>symbols[0]
    _StreamCreateWithFlags = <int (*)(cudaStream_t*, unsigned) noexcept nogil>symbols[1]
    _StreamSynchronize = <int (*)(cudaStream_t) noexcept nogil>symbols[2]
    _StreamWaitEvent = <int (*)(cudaStream_t, cudaEvent_t, unsigned) noexcept nogil>symbols[3]
    _EventCreateWithFlags = <int (*)(cudaEvent_t*, unsigned) noexcept nogil>symbols[4]
    _EventRecord = <int (*)(cudaEvent_t, cudaStream_t) noexcept nogil>symbols[5]
    _EventSynchronize = <int (*)(cudaEvent_t) noexcept nogil>symbols[6]
    _MemcpyAsync = <int (*)(void*, const void*, size_t, int, cudaStream_t) noexcept nogil>(
        symbols[7])
    _HostAlloc = <int (*)(void**, size_t, unsigned) noexcept nogil>symbols[8]
    _FreeHost = <int (*)(void*) noexcept nogil>symbols[9]
    _GetErrorString = <const char* (*)(int) noexcept nogil>symbols[10]
    _RuntimeGetVersion = <int (*)(int*) noexcept nogil>symbols[11]
    _StreamIsCapturing = <int (*)(cudaStream_t, int*) noexcept nogil>symbols[12]
    _Malloc = <int (*)(void**, size_t) noexcept nogil>symbols[13]
    _Free = <int (*)(void*) noexcept nogil>symbols[14]
    _Memset = <int (*)(void*, int, size_t) noexcept nogil>symbols[15]
    _GetDeviceCount = <int (*)(int*) noexcept nogil>symbols[16]
    _SetDevice = <int (*)(int) noexcept nogil>symbols[17]
    _library_path = path
    _library = handle
    return 0


cdef int _check(int err, const char* what) except -1 nogil:
    if err == cudaSuccess:
        return 0
    with gil:
        raise RuntimeError(f"fastreduce: CUDA {what.decode()} failed: "
                           f"{_GetErrorString(err).decode(errors='replace')} (error {err})")


cdef int require_device(int device_type, int device_id, str role) except -1:
    """Make sure CUDA is loaded and `device_id` is this thread's current device."""
    if _library == NULL:
        load_runtime(role, device_id)
    cdef int current = -1
    cdef int err = _GetDevice(&current)
    if err != cudaSuccess:
        raise RuntimeError(
            f"fastreduce: {role} is on cuda:{device_id}, but CUDA cannot be used in this "
            f"process: {_GetErrorString(err).decode(errors='replace')} (error {err}, runtime "
            f"{_library_path}); check the NVIDIA driver and CUDA_VISIBLE_DEVICES")
    if current != device_id:
        kind = "cuda" if device_type == kDLCUDA else "cuda (managed memory)"
        raise ValueError(
            f"fastreduce: {role} is on {kind}:{device_id} but this rank's current CUDA device "
            f"is cuda:{current}; select the device first (torch.cuda.set_device({device_id}), "
            f"usually torch.cuda.set_device(fastreduce.local_rank() % "
            f"torch.cuda.device_count())) or move the tensor to cuda:{current}")
    if device_id >= MAX_DEVICES:
        raise ValueError(f"fastreduce: device cuda:{device_id} is beyond the {MAX_DEVICES} "
                         f"devices this fastreduce handles per process")
    return 0


cdef cudaStream_t consumer_stream(int device_id) except? NULL:
    """fastreduce's own stream on the (current) device, for producers that take one."""
    if _consumer_streams[device_id] == NULL:
        _check(_StreamCreateWithFlags(&_consumer_streams[device_id], cudaStreamNonBlocking),
               b"cudaStreamCreateWithFlags")
    return _consumer_streams[device_id]


cdef int check_not_capturing(cudaStream_t stream, str role) except -1:
    """RuntimeError, before anything is queued, when `stream` is being captured into a graph."""
    cdef int status = 0
    cdef int err = _StreamIsCapturing(stream, &status)
    if err != cudaSuccess:
        _check(err, b"cudaStreamIsCapturing")
    if status != 0:  # cudaStreamCaptureStatusActive, or Invalidated
        raise RuntimeError(
            f"fastreduce: {role}'s stream is being captured into a CUDA graph, and an MPI "
            f"call cannot be captured (it would not run when the graph is replayed); run the "
            f"collective outside the captured region, e.g. between graph replays or in eager "
            f"mode (torch.cuda.graph / make_graphed_callables: keep fastreduce calls out)")
    return 0


cdef int use_device(int device) except -1 nogil:
    """Make `device` current for this thread (the progress engine's, for a job's device)."""
    return _check(_SetDevice(device), b"cudaSetDevice")


# --- device memory for calibration ----------------------------------------------------

def device_count() -> int:
    """cudaGetDeviceCount (loads the runtime)."""
    cdef int n = 0
    load_runtime("fastreduce", 0)
    _check(_GetDeviceCount(&n), b"cudaGetDeviceCount")
    return n


def current_device() -> int:
    """This thread's current CUDA device (loads the runtime)."""
    cdef int device = 0
    load_runtime("fastreduce", 0)
    _check(_GetDevice(&device), b"cudaGetDevice")
    return device


def set_device(int device) -> None:
    """cudaSetDevice for this thread."""
    load_runtime("fastreduce", device)
    _check(_SetDevice(device), b"cudaSetDevice")


def device_alloc(size_t nbytes) -> int:
    """cudaMalloc of nbytes on the current device, zeroed; free it with device_free."""
    cdef void* ptr = NULL
    load_runtime("fastreduce", 0)
    _check(_Malloc(&ptr, max(nbytes, 1)), b"cudaMalloc")
    cdef int err = _Memset(ptr, 0, nbytes)
    if err == cudaSuccess:  # cudaMemset may return before it is done: wait for it
        err = _StreamSynchronize(NULL)
    if err != cudaSuccess:
        _Free(ptr)
        _check(err, b"cudaMemset")
    return <size_t>ptr


def device_free(size_t ptr) -> None:
    _check(_Free(<void*>ptr), b"cudaFree")


# --- counted primitives ---------------------------------------------------------------

cdef int copy_async(void* dst, const void* src, size_t nbytes, int kind,
                    cudaStream_t stream) except -1 nogil:
    global _d2h_copies, _h2d_copies, _d2h_bytes, _h2d_bytes
    if kind == MEMCPY_D2H:
        _d2h_copies += 1
        _d2h_bytes += nbytes
    else:
        _h2d_copies += 1
        _h2d_bytes += nbytes
    return _check(_MemcpyAsync(dst, src, nbytes, kind, stream), b"cudaMemcpyAsync")


cdef int stream_sync(cudaStream_t stream) except -1 nogil:
    """Wait on the host for work queued on one stream (never the whole device)."""
    global _stream_syncs
    _stream_syncs += 1
    if _skip_waits:
        return 0
    return _check(_StreamSynchronize(stream), b"cudaStreamSynchronize")


cdef int event_record(cudaEvent_t event, cudaStream_t stream) except -1 nogil:
    return _check(_EventRecord(event, stream), b"cudaEventRecord")


cdef int event_sync(cudaEvent_t event) except -1 nogil:
    global _event_syncs
    _event_syncs += 1
    if _skip_waits:
        return 0
    return _check(_EventSynchronize(event), b"cudaEventSynchronize")


cdef int stream_wait_event(cudaStream_t stream, cudaEvent_t event) except -1 nogil:
    """Order the stream's later work after the event, without blocking the host."""
    return _check(_StreamWaitEvent(stream, event, 0), b"cudaStreamWaitEvent")


# --- staging contexts -----------------------------------------------------------------

cdef int staging_order(Staging* ctx, cudaStream_t stream) except -1 nogil:
    """Order `stream` after the last GPU use of ctx's pinned memory (free on its own stream).

    Assumes a stream handle is not destroyed and reused while its work is queued
    (torch and cupy keep their streams for the life of the process).
    """
    if ctx.done_stream != stream:
        stream_wait_event(stream, ctx.done)
    return 0


cdef int staging_release(Staging* ctx, cudaStream_t stream) except -1 nogil:
    """Mark the end of ctx's pinned memory's use by the work queued so far on `stream`."""
    event_record(ctx.done, stream)
    ctx.done_stream = stream
    return 0


cdef int _new_event(cudaEvent_t* event) except -1:
    return _check(_EventCreateWithFlags(event, cudaEventDisableTiming),
                  b"cudaEventCreateWithFlags")


cdef Staging* _new_context(int device_id) except NULL:
    cdef Staging* ctx = <Staging*>calloc(1, sizeof(Staging))
    if ctx == NULL:
        raise MemoryError("fastreduce: out of memory for a staging context")
    ctx.device = device_id
    cdef int i
    try:
        _check(_StreamCreateWithFlags(&ctx.d2h_stream, cudaStreamNonBlocking),
               b"cudaStreamCreateWithFlags")
        _check(_StreamCreateWithFlags(&ctx.h2d_stream, cudaStreamNonBlocking),
               b"cudaStreamCreateWithFlags")
        _new_event(&ctx.start)
        _new_event(&ctx.done)
        for i in range(STAGING_SLOTS):
            _new_event(&ctx.d2h[i])
            _new_event(&ctx.h2d[i])
    except BaseException:
        free(ctx)  # the few handles made so far are kept by the runtime until exit
        raise
    return ctx


cdef int _grow(Staging* ctx, size_t nbytes) except -1:
    """Pinned memory for at least nbytes: the next power of two (>= 64 KiB), once."""
    global _pinned_allocs, _pinned_bytes
    cdef size_t size = 64 << 10
    while size < nbytes:
        size <<= 1
    cdef void* memory = NULL
    _check(_HostAlloc(&memory, size, cudaHostAllocPortable), b"cudaHostAlloc")
    if ctx.host != NULL:
        with nogil:
            _check(_EventSynchronize(ctx.done), b"cudaEventSynchronize")  # its last GPU use
        _check(_FreeHost(ctx.host), b"cudaFreeHost")
        _pinned_bytes -= ctx.capacity
    ctx.host = <char*>memory
    ctx.capacity = size
    _pinned_allocs += 1
    _pinned_bytes += size
    return 0


cdef Staging* staging_take(int device_id, size_t nbytes) except NULL:
    """A cached staging context of the current device with >= nbytes of pinned memory."""
    cdef Staging* ctx = _free_contexts[device_id]
    if ctx != NULL:
        _free_contexts[device_id] = ctx.next
        ctx.next = NULL
    else:
        ctx = _new_context(device_id)
    if ctx.capacity < nbytes:
        try:
            _grow(ctx, nbytes)
        except BaseException:
            staging_give(ctx)
            raise
    return ctx


cdef void staging_give(Staging* ctx) noexcept:
    """Return a context for reuse; its `done` event marks when its memory is free."""
    ctx.next = _free_contexts[ctx.device]
    _free_contexts[ctx.device] = ctx


cdef int64_t chunk_bytes(int64_t nbytes) noexcept nogil:
    """Bytes per pipelined chunk of an nbytes staged reduction (nbytes: no pipelining).

    With k chunks the copies add about (t_d2h + t_h2d) / k to the MPI time, and each
    chunk costs a fixed overhead o (an MPI call, an event); k = sqrt((t_d2h + t_h2d) / o)
    minimises the sum. For PCIe-class copy bandwidth and o of some 10 us this is
    chunks of about sqrt(nbytes * 256 KiB): 512 KiB at 1 MiB, 8 MiB at 256 MiB.
    """
    cdef int64_t size
    if _fixed_chunk > 0:
        return min(_fixed_chunk, nbytes) if nbytes > 0 else 0
    if nbytes <= PIPELINE_MIN_BYTES:
        return nbytes
    size = <int64_t>sqrt(<double>nbytes * (256 << 10))
    size = max(CHUNK_MIN_BYTES, min(CHUNK_MAX_BYTES, size))
    return size // CHUNK_ALIGN * CHUNK_ALIGN


cdef int64_t movement_chunk_bytes(int64_t nbytes, bint pipelines_small) noexcept nogil:
    """Bytes per pipelined chunk of a staged data-movement call of equal blocks, nbytes of
    every block together (nbytes: staged whole). As chunk_bytes, but a call that moves
    bytes without reducing them (not `pipelines_small`: broadcast, all-gather, gather,
    all-to-all) goes whole up to MOVE_WHOLE_MAX_BYTES: each chunk is one more MPI call over
    every rank and a copy per block, and on an H200 with Open MPI 4.1.6 (2 and 4 ranks,
    2026-11-29, docs/benchmarks.md) these calls were 2-20% slower pipelined than whole
    from 1 to 4 MiB and 0-17% faster from 16 MiB. Reductions (reduce, reduce-scatter) and
    scatter were faster pipelined from 4 MiB (smaller MPI calls of theirs cost less per
    byte there) and keep chunk_bytes' plan. A fixed chunk (set_staging_chunk) applies to
    every call."""
    if _fixed_chunk <= 0 and not pipelines_small and nbytes <= MOVE_WHOLE_MAX_BYTES:
        return nbytes
    return chunk_bytes(nbytes)


PIPELINES_SMALL = frozenset(("allreduce", "reduce", "reduce_scatter", "scatter"))
MOVEMENT_CALLS = frozenset(("broadcast", "allgather", "gather", "alltoall")) | PIPELINES_SMALL


def plan_staging(int64_t nbytes, str call="allreduce") -> tuple:
    """(bytes per chunk, number of chunks) of a staged call of nbytes: the all-reduce, or
    a data-movement call of equal blocks (nbytes of the whole call, each chunk a share of
    every block): broadcast, reduce, allgather, gather, scatter, reduce_scatter, alltoall."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    if call not in MOVEMENT_CALLS:
        raise ValueError(f"plan_staging: call {call!r}: give one of "
                         f"{', '.join(sorted(MOVEMENT_CALLS))}")
    cdef int64_t size = movement_chunk_bytes(nbytes, call in PIPELINES_SMALL)
    return size, (nbytes + size - 1) // size if size else 0


def set_staging_chunk(int64_t nbytes) -> int:
    """Fix the staged path's chunk size in bytes (a multiple of 16; 0: automatic); returns old."""
    global _fixed_chunk
    if nbytes < 0 or nbytes % 16:
        raise ValueError(f"fastreduce: staging chunk of {nbytes} bytes: give 0 (automatic) "
                         f"or a positive multiple of 16")
    old, _fixed_chunk = _fixed_chunk, nbytes
    _forget_plans()  # the ranks agree on it again: chunks are MPI calls
    return old


def staging_chunk() -> int:
    """The staged path's fixed chunk size in bytes (0: automatic, by size)."""
    return _fixed_chunk


def copy_counts() -> dict:
    """Copies, host waits and pinned memory of the GPU paths since reset_copy_counts() (the
    path each call took: pathchoice.path_counts(); both: fastreduce.gpupaths.gpu_copy_counts)."""
    return {"d2h_copies": _d2h_copies, "h2d_copies": _h2d_copies, "d2h_bytes": _d2h_bytes,
            "h2d_bytes": _h2d_bytes, "stream_syncs": _stream_syncs,
            "event_syncs": _event_syncs, "pinned_allocs": _pinned_allocs,
            "pinned_bytes": _pinned_bytes}


def reset_copy_counts() -> None:
    """Zero copy_counts() (pinned_bytes, the memory held now, is kept)."""
    global _d2h_copies, _h2d_copies, _d2h_bytes, _h2d_bytes, _stream_syncs, _event_syncs
    global _pinned_allocs
    _d2h_copies = _h2d_copies = _d2h_bytes = _h2d_bytes = 0
    _stream_syncs = _event_syncs = _pinned_allocs = 0


def find_runtime() -> str:
    """Load the CUDA runtime now (it is otherwise loaded at the first GPU tensor) and say
    which one; RuntimeError naming what was tried when none can be loaded."""
    load_runtime("fastreduce-info", 0)
    info = runtime_info()
    return f"{info['path']} (CUDA {info['version']})"


def runtime_info() -> dict:
    """The CUDA runtime fastreduce loaded: its path and version (None until first GPU use)."""
    cdef int version = 0
    if _library == NULL:
        return {"path": None, "version": None}
    _check(_RuntimeGetVersion(&version), b"cudaRuntimeGetVersion")
    return {"path": _library_path, "version": f"{version // 1000}.{version % 1000 // 10}"}


def _set_skip_waits(bint skip) -> None:
    """Tests only: skip every host wait, to show that the ordering tests then fail."""
    global _skip_waits
    _skip_waits = skip
