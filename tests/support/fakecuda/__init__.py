"""A fake CUDA runtime for tests, and a CUDA DLPack producer living in its memory.

fastreduce loads the CUDA runtime named by FASTREDUCE_CUDART; set that to `library_path()` and
its GPU code paths run on any machine. The fake's "device memory" is ordinary host memory and
every stream is a worker thread running its operations in order, so copies really are
asynchronous (FAKECUDA_COPY_DELAY_US delays each one) and stream ordering mistakes show up as
stale data. fakecudart.c describes the model.

    os.environ["FASTREDUCE_CUDART"] = fakecuda.library_path()
    x = fakecuda.FakeCudaArray.from_numpy(np.arange(4.0))
    fakecuda.reset_counters()
    ...
    assert fakecuda.counters()["pageable_async_copies"] == 0
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import operator
import os
import subprocess
import sys
import tempfile
import threading
from ctypes import POINTER, Structure, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fakecudart.c"
CFLAGS = ["-O1", "-shared", "-fPIC", "-pthread"]
# Never unmap the library: its detached stream threads may outlive every dlclose().
LDFLAGS = ["-Wl,-z,nodelete"]

# cudaError_t values the fake returns
SUCCESS, INVALID_VALUE, MEMORY_ALLOCATION = 0, 1, 2
INVALID_DEVICE, INVALID_RESOURCE_HANDLE, NOT_READY = 101, 400, 600
CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED = 900, 901
# cudaStreamCaptureStatus
CAPTURE_NONE, CAPTURE_ACTIVE, CAPTURE_INVALIDATED_STATUS = 0, 1, 2
# cudaMemcpyKind
HOST_TO_HOST, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE, MEMCPY_DEFAULT = range(5)
# DLPack device types
KDL_CUDA, KDL_CUDA_MANAGED = 2, 13

COUNTER_FIELDS = (
    "d2h_copies", "h2d_copies", "d2d_copies", "d2h_bytes", "h2d_bytes",
    "pageable_async_copies", "stream_syncs", "event_syncs", "device_syncs",
    "stream_wait_events", "host_allocs", "host_frees", "device_allocs", "device_frees",
    "streams_created", "events_created", "bad_copies", "capture_violations",
)


class _Counters(Structure):
    _fields_ = [(name, c_uint64) for name in COUNTER_FIELDS]


class _CopyRecord(Structure):
    _fields_ = [("kind", ctypes.c_int), ("stream", c_uint64), ("bytes", c_uint64),
                ("start_ns", ctypes.c_int64), ("end_ns", ctypes.c_int64)]


class CudaError(RuntimeError):
    """A fake CUDA call returned an error; `.code` is the cudaError_t."""

    def __init__(self, code: int, what: str):
        self.code = code
        super().__init__(f"{what}: error {code} ({error_string(code)})")


# ---------------------------------------------------------------------------- building

def build_library(source: Path, stem: str, directory: Path, cc: str, cflags: list[str],
                  ldflags: list[str]) -> Path:
    """Compile `source` into the shared library `directory`/<stem>-<hash>.so unless it is there
    already; return its path.

    The name carries a hash of the source, compiler and flags, so an edit rebuilds. Each caller
    compiles to a file of its own and renames it into place, so concurrent callers (MPI ranks
    starting together) never see a half-written library.
    """
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join([cc, *cflags, *ldflags]).encode()).hexdigest()[:16]
    target = directory / f"{stem}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([cc, *cflags, "-o", tmp, str(source), *ldflags],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building {source.name} failed:\n{done.stderr}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_in_test_tree(build) -> str:
    """build(directory) into tests/<its package>/_build/, or a temporary directory where that
    cannot be written (FAKECUDA_BUILD_DIR overrides both); the library's path."""
    chosen = os.environ.get("FAKECUDA_BUILD_DIR")
    if chosen:
        return str(build(Path(chosen)))
    try:
        return str(build(None))
    except OSError:
        return str(build(Path(tempfile.gettempdir()) / f"fakecuda-{os.getuid()}"))


def _build_into(directory: Path) -> Path:
    """The fake CUDA runtime, built into `directory` (see build_library)."""
    return build_library(SOURCE, "libfakecudart", directory, os.environ.get("CC", "cc"), CFLAGS,
                         LDFLAGS)


_path_lock = threading.Lock()
_path: str | None = None


def library_path() -> str:
    """The fake CUDA runtime's path, built on first use (into tests/support/fakecuda/_build/, or a
    temporary directory where that cannot be written; FAKECUDA_BUILD_DIR overrides both)."""
    global _path
    with _path_lock:
        if _path is None:
            _path = build_in_test_tree(lambda d: _build_into(d or HERE / "_build"))
        return _path


# ---------------------------------------------------------------------------- bindings

_SIGNATURES = {
    "cudaGetDeviceCount": (c_int, [POINTER(c_int)]),
    "cudaGetDevice": (c_int, [POINTER(c_int)]),
    "cudaSetDevice": (c_int, [c_int]),
    "cudaStreamCreateWithFlags": (c_int, [POINTER(c_void_p), c_uint]),
    "cudaStreamDestroy": (c_int, [c_void_p]),
    "cudaStreamSynchronize": (c_int, [c_void_p]),
    "cudaStreamWaitEvent": (c_int, [c_void_p, c_void_p, c_uint]),
    "cudaStreamQuery": (c_int, [c_void_p]),
    "cudaEventCreateWithFlags": (c_int, [POINTER(c_void_p), c_uint]),
    "cudaEventDestroy": (c_int, [c_void_p]),
    "cudaEventRecord": (c_int, [c_void_p, c_void_p]),
    "cudaEventSynchronize": (c_int, [c_void_p]),
    "cudaEventQuery": (c_int, [c_void_p]),
    "cudaMemcpyAsync": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_void_p]),
    "cudaMemcpy": (c_int, [c_void_p, c_void_p, c_size_t, c_int]),
    "cudaHostAlloc": (c_int, [POINTER(c_void_p), c_size_t, c_uint]),
    "cudaFreeHost": (c_int, [c_void_p]),
    "cudaMalloc": (c_int, [POINTER(c_void_p), c_size_t]),
    "cudaFree": (c_int, [c_void_p]),
    "cudaGetErrorString": (c_char_p, [c_int]),
    "cudaGetLastError": (c_int, []),
    "cudaDeviceSynchronize": (c_int, []),
    "cudaDriverGetVersion": (c_int, [POINTER(c_int)]),
    "cudaRuntimeGetVersion": (c_int, [POINTER(c_int)]),
    "cudaMemset": (c_int, [c_void_p, c_int, c_size_t]),
    "cudaStreamBeginCapture": (c_int, [c_void_p, c_int]),
    "cudaStreamEndCapture": (c_int, [c_void_p, POINTER(c_void_p)]),
    "cudaStreamIsCapturing": (c_int, [c_void_p, POINTER(c_int)]),
    "fakecuda_pointer_kind": (c_int, [c_void_p]),
    "fakecuda_fail_event_syncs": (None, [c_int, c_int]),
    "fakecuda_get_counters": (None, [POINTER(_Counters)]),
    "fakecuda_reset_counters": (None, []),
    "fakecuda_counters_size": (c_size_t, []),
    "fakecuda_launch_write": (c_int, [c_void_p, c_void_p, c_void_p, c_size_t, c_uint]),
    "fakecuda_quiesce": (None, []),
    "fakecuda_log_copies": (c_int, [c_size_t]),
    "fakecuda_dlpack_deleter": (None, [c_void_p]),
    "fakecuda_dlpack_capsule_destructor": (None, [c_void_p]),
}

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def lib() -> ctypes.CDLL:
    """The loaded fake runtime, with argtypes and restypes set.

    It is the same instance fastreduce gets when FASTREDUCE_CUDART names `library_path()`
    (dlopen returns one handle per file), so the counters here count fastreduce's calls.
    """
    global _lib
    with _lib_lock:
        if _lib is None:
            loaded = ctypes.CDLL(library_path())
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.restype, fn.argtypes = restype, argtypes
            if loaded.fakecuda_counters_size() != ctypes.sizeof(_Counters):
                raise RuntimeError("fakecuda: COUNTER_FIELDS does not match the C struct")
            _lib = loaded
        return _lib


def check(code: int, what: str = "fake CUDA call") -> None:
    """Raise CudaError unless `code` is cudaSuccess."""
    if code != SUCCESS:
        raise CudaError(code, what)


def error_string(code: int) -> str:
    """cudaGetErrorString."""
    return lib().cudaGetErrorString(code).decode()


def counters() -> dict[str, int]:
    """The fake's counters (copies, bytes, syncs, allocations...) since the last reset."""
    out = _Counters()
    lib().fakecuda_get_counters(ctypes.byref(out))
    return {name: getattr(out, name) for name in COUNTER_FIELDS}


def reset_counters() -> None:
    lib().fakecuda_reset_counters()


def fail_event_syncs(n: int, after: int = 0) -> None:
    """After `after` more that succeed, the next n cudaEventSynchronize calls (from any
    thread) fail with error 700."""
    lib().fakecuda_fail_event_syncs(n, after)


def log_copies(capacity: int) -> None:
    """Record the next `capacity` copies the streams run (0: stop); see copy_log()."""
    check(lib().fakecuda_log_copies(capacity), "fakecuda_log_copies")


def copy_log() -> list[dict]:
    """The copies recorded since log_copies(): kind ("H2D", "D2H", ..., "write" for
    launch_write's), stream (an id),
    bytes, start and end (CLOCK_MONOTONIC ns, time.monotonic_ns()'s clock), in the order
    they ended."""
    fn = lib().fakecuda_copy_log
    fn.restype, fn.argtypes = c_size_t, [POINTER(_CopyRecord), c_size_t]
    n = fn(None, 0)
    out = (_CopyRecord * n)()
    n = min(n, fn(out, n))
    names = {HOST_TO_HOST: "H2H", HOST_TO_DEVICE: "H2D", DEVICE_TO_HOST: "D2H",
             DEVICE_TO_DEVICE: "D2D", -1: "write"}
    return [{"kind": names[r.kind], "stream": r.stream, "bytes": r.bytes,
             "start": r.start_ns, "end": r.end_ns} for r in out[:n]]


def quiesce() -> None:
    """Wait until every stream is idle (not counted as a device synchronization)."""
    lib().fakecuda_quiesce()


# ---------------------------------------------------------------------------- streams, events

class Stream:
    """A fake CUDA stream; non-blocking (flags=1, like torch's and cupy's pools) by default."""

    def __init__(self, flags: int = 1):
        handle = c_void_p()
        check(lib().cudaStreamCreateWithFlags(ctypes.byref(handle), flags),
              "cudaStreamCreateWithFlags")
        self.handle: int = handle.value
        self._alive = True

    def synchronize(self) -> None:
        check(lib().cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")

    def begin_capture(self) -> None:
        """cudaStreamBeginCapture: work queued from now on would go into a CUDA graph."""
        check(lib().cudaStreamBeginCapture(self.handle, 0), "cudaStreamBeginCapture")

    def end_capture(self) -> int:
        """cudaStreamEndCapture; returns its error code (901: the capture was invalidated)."""
        graph = c_void_p()
        return lib().cudaStreamEndCapture(self.handle, ctypes.byref(graph))

    def capture_status(self) -> int:
        """cudaStreamIsCapturing: CAPTURE_NONE, CAPTURE_ACTIVE or CAPTURE_INVALIDATED_STATUS."""
        status = c_int()
        check(lib().cudaStreamIsCapturing(self.handle, ctypes.byref(status)),
              "cudaStreamIsCapturing")
        return status.value

    def query(self) -> bool:
        """True when all work enqueued so far has run."""
        code = lib().cudaStreamQuery(self.handle)
        if code not in (SUCCESS, NOT_READY):
            check(code, "cudaStreamQuery")
        return code == SUCCESS

    def destroy(self) -> None:
        """Release the handle (pending work still runs). Idempotent."""
        if self._alive:
            self._alive = False
            check(lib().cudaStreamDestroy(self.handle), "cudaStreamDestroy")

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # interpreter shutdown
            pass

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        return f"<fakecuda.Stream {self.handle:#x}>"


class Event:
    """A fake CUDA event."""

    def __init__(self, flags: int = 2):  # cudaEventDisableTiming
        handle = c_void_p()
        check(lib().cudaEventCreateWithFlags(ctypes.byref(handle), flags),
              "cudaEventCreateWithFlags")
        self.handle: int = handle.value

    def record(self, stream: Stream | int | None = None) -> None:
        check(lib().cudaEventRecord(self.handle, stream_handle(stream)), "cudaEventRecord")

    def synchronize(self) -> None:
        check(lib().cudaEventSynchronize(self.handle), "cudaEventSynchronize")

    def query(self) -> bool:
        code = lib().cudaEventQuery(self.handle)
        if code not in (SUCCESS, NOT_READY):
            check(code, "cudaEventQuery")
        return code == SUCCESS

    def wait(self, stream: Stream | int | None = None) -> None:
        """Make `stream` wait for this event's current record."""
        check(lib().cudaStreamWaitEvent(stream_handle(stream), self.handle, 0),
              "cudaStreamWaitEvent")

    def destroy(self) -> None:
        if self.handle:
            handle, self.handle = self.handle, 0
            check(lib().cudaEventDestroy(handle), "cudaEventDestroy")

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # interpreter shutdown
            pass


def stream_handle(stream: Stream | int | None) -> int:
    """The raw handle of a Stream, an int handle, or None (0: the legacy default stream)."""
    if stream is None:
        return 0
    return stream.handle if isinstance(stream, Stream) else int(stream)


def launch_write(stream: Stream | int | None, dst_ptr: int, data, delay_us: int = 0) -> None:
    """Enqueue a "kernel" on `stream` that sleeps `delay_us` and then writes `data` (bytes or
    an array; copied now, so it may change at once) to `dst_ptr`. Not counted as a copy."""
    if isinstance(data, bytes | bytearray | memoryview):
        data = np.frombuffer(data, np.uint8)
    buf = np.ascontiguousarray(data)
    check(lib().fakecuda_launch_write(stream_handle(stream), dst_ptr, buf.ctypes.data,
                                      buf.nbytes, delay_us),
          "fakecuda_launch_write")


# ---------------------------------------------------------------------------- DLPack producer

def _fake_dlpack():
    """tests/support/fake_dlpack.py, which holds the ctypes DLPack structs: the module tests
    import under that name if it is loaded already, else loaded from its file (and registered
    under that name, so that later imports share it)."""
    if "fake_dlpack" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "fake_dlpack", HERE.parent / "fake_dlpack.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["fake_dlpack"] = module
        spec.loader.exec_module(module)
    return sys.modules["fake_dlpack"]


_dl = _fake_dlpack()
DLDevice, DLDataType, DLTensor = _dl.DLDevice, _dl.DLDataType, _dl.DLTensor
DLManagedTensor, DLManagedTensorVersioned = _dl.DLManagedTensor, _dl.DLManagedTensorVersioned
DLPackVersion, KDL = _dl.DLPackVersion, _dl.KDL

# A private function object (indexing makes a new one), so that setting its argtypes cannot
# disturb other users of ctypes.pythonapi.
_capsule_new = ctypes.pythonapi["PyCapsule_New"]
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [c_void_p, c_void_p, c_void_p]

# Capsule names: PyCapsule_New keeps the pointer, not a copy, so they must live forever.
_NAMES = {False: ctypes.create_string_buffer(b"dltensor"),
          True: ctypes.create_string_buffer(b"dltensor_versioned")}


def _export_struct(managed_type) -> type[Structure]:
    """A managed tensor preceded by the release count that the C deleter increments."""
    return type(f"_Export{managed_type.__name__}", (Structure,),
                {"_fields_": [("released", c_uint64), ("managed", managed_type)]})


_EXPORT_TYPES = {False: _export_struct(DLManagedTensor),
                 True: _export_struct(DLManagedTensorVersioned)}

# What each export keeps alive (the array's memory, the struct, shape and strides), by the
# export struct's address, until its deleter has run. The deleter and capsule destructor are C
# functions in the fake runtime (see fakecudart.c for why); _reap() notices their work.
_exports: dict[int, tuple] = {}
_exports_lock = threading.Lock()


def _reap() -> None:
    """Drop the exports whose deleter has run."""
    with _exports_lock:
        for address in [a for a, entry in _exports.items() if entry[1].released]:
            del _exports[address]


def live_exports() -> int:
    """DLPack exports of FakeCudaArrays whose deleter has not run yet, all arrays together."""
    _reap()
    return len(_exports)


class _DeviceBuffer:
    """A cudaMalloc allocation, freed once nothing (array or export) refers to it."""

    def __init__(self, nbytes: int):
        ptr = c_void_p()
        check(lib().cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
        self.ptr: int = ptr.value
        self.nbytes = nbytes

    def __del__(self):
        try:
            lib().cudaFree(self.ptr)
        except Exception:  # interpreter shutdown
            pass


class FakeCudaArray:
    """An n-d array in fake device memory that exports itself over DLPack as a CUDA tensor.

    Its producer stream (`stream`: a Stream, or None for the legacy default stream) is where
    writes to it are enqueued; `__dlpack__` orders a consumer stream after it the way CUDA
    producers do (an event recorded on the producer stream, waited on by the consumer's).
    """

    def __init__(self, shape, dtype, *, device: int = 0, stream: Stream | None = None,
                 dlpack_dtype: tuple[int, int, int] | None = None,
                 device_type: int = KDL_CUDA):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.device_type = device_type
        self.stream = stream
        kind = {"i": "int", "u": "uint", "f": "float", "c": "complex", "b": "bool"}
        if dlpack_dtype is None:
            dlpack_dtype = (KDL[kind[self.dtype.kind]], self.dtype.itemsize * 8, 1)
        self.dlpack_dtype = tuple(dlpack_dtype)
        _reap()  # free what released exports still held before allocating more
        self._buf = _DeviceBuffer(self.nbytes)
        self.exports = 0  # __dlpack__ calls
        self.last_export_stream = None  # the `stream` argument of the latest __dlpack__ call

    @classmethod
    def from_numpy(cls, arr, device: int = 0, stream: Stream | None = None, delay_us: int = 0,
                   **kwargs) -> FakeCudaArray:
        """A device copy of `arr`, written by a "kernel" on `stream` after `delay_us`.

        kwargs go to the constructor (dlpack_dtype, device_type).
        """
        arr = np.ascontiguousarray(arr)
        out = cls(arr.shape, arr.dtype, device=device, stream=stream, **kwargs)
        launch_write(stream, out.ptr, arr, delay_us)
        return out

    @property
    def ptr(self) -> int:
        return self._buf.ptr

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def live_exports(self) -> int:
        """Exports of this array whose deleter has not run yet."""
        _reap()
        with _exports_lock:
            return sum(entry[0] is self._buf for entry in _exports.values())

    def write(self, arr, delay_us: int = 0, stream: Stream | int | None = None) -> None:
        """Enqueue a write of `arr`'s bytes on `stream` (default: the producer stream)."""
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        if arr.nbytes != self.nbytes:
            raise ValueError(f"{arr.nbytes} bytes into a {self.nbytes}-byte array")
        launch_write(self.stream if stream is None else stream, self.ptr, arr, delay_us)

    def to_numpy(self) -> np.ndarray:
        """The contents once every stream is idle (a plain memmove: no counted copy)."""
        quiesce()
        out = np.empty(self.shape, self.dtype)
        ctypes.memmove(out.ctypes.data, self.ptr, self.nbytes)
        return out

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, self.device)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.exports += 1
        self.last_export_stream = stream
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"cannot export to device {dl_device}")
        if copy:
            raise BufferError("FakeCudaArray cannot export a copy")
        self._order_consumer(stream)
        return self._capsule(max_version is not None and max_version[0] >= 1)

    def _order_consumer(self, stream) -> None:
        """DLPack's CUDA stream rules: None or 1 is the legacy default stream, 2 the
        per-thread default stream, -1 asks for no synchronization, other ints are handles."""
        if stream == -1:
            return
        try:
            stream = 1 if stream is None else operator.index(stream)
        except TypeError:
            raise ValueError(f"invalid CUDA stream for DLPack: {stream!r}") from None
        if stream == 0:  # ambiguous, so DLPack forbids it
            raise ValueError("invalid CUDA stream for DLPack: 0")
        # The fake has one legacy stream for handles 0, 1 and 2.
        consumer = 0 if stream in (1, 2) else stream
        if consumer == stream_handle(self.stream):
            return
        event = Event()
        event.record(self.stream)
        event.wait(consumer)
        event.destroy()  # the pending record and wait still happen

    def _capsule(self, versioned: bool):
        _reap()
        export = _EXPORT_TYPES[versioned]()
        managed = export.managed
        t = managed.dl_tensor
        shape = (ctypes.c_int64 * max(self.ndim, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(self.ndim, 1))(*_c_strides(self.shape))
        t.data = self.ptr
        t.device = DLDevice(*self.__dlpack_device__())
        t.ndim = self.ndim
        t.dtype = DLDataType(*self.dlpack_dtype)
        t.shape = ctypes.cast(shape, POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(strides, POINTER(ctypes.c_int64))
        t.byte_offset = 0
        if versioned:
            managed.version = DLPackVersion(1, 0)
            managed.flags = 0
        runtime = lib()
        managed.deleter = ctypes.cast(runtime.fakecuda_dlpack_deleter, c_void_p).value
        with _exports_lock:
            _exports[ctypes.addressof(export)] = (self._buf, export, shape, strides)
        destructor = ctypes.cast(runtime.fakecuda_dlpack_capsule_destructor, c_void_p).value
        return _capsule_new(ctypes.addressof(managed), ctypes.addressof(_NAMES[versioned]),
                            destructor)

    def __repr__(self) -> str:
        return (f"<FakeCudaArray shape={self.shape} dtype={self.dtype} ptr={self.ptr:#x} "
                f"device={self.__dlpack_device__()} stream={self.stream!r}>")


def _c_strides(shape) -> list[int]:
    """Row-major strides in elements."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def empty_like(x: FakeCudaArray) -> FakeCudaArray:
    """A new uninitialised array like x (what consumers call to allocate a result)."""
    return type(x)(x.shape, x.dtype, device=x.device, stream=x.stream,
                   dlpack_dtype=x.dlpack_dtype, device_type=x.device_type)


# ------------------------------------------------------------- the DLPack C exchange API
#
# FakeCudaTensor is read through `type(x).__dlpack_c_exchange_api__`, as torch tensors are:
# no __dlpack__ call, and the consumer asks the framework for its current work stream
# (set_current_stream here, like torch.cuda.set_stream) instead of passing its own.

class _ExchangeAPIHeader(Structure):
    _fields_ = [("version", DLPackVersion), ("prev_api", c_void_p)]


class _ExchangeAPI(Structure):
    _fields_ = [("header", _ExchangeAPIHeader), ("managed_tensor_allocator", c_void_p),
                ("managed_tensor_from_py_object_no_sync", c_void_p),
                ("managed_tensor_to_py_object_no_sync", c_void_p),
                ("dltensor_from_py_object_no_sync", c_void_p),
                ("current_work_stream", c_void_p)]


_current_stream: Stream | None = None
stream_queries: list[tuple[int, int]] = []  # (device_type, device_id) of each stream query


def set_current_stream(stream: Stream | None) -> None:
    """The framework's current work stream that FakeCudaTensor reports (None: legacy)."""
    global _current_stream
    _current_stream = stream


@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, POINTER(DLTensor))
def _dltensor_from_py_object(obj, out):
    t = out.contents
    t.data = obj.ptr
    t.device = DLDevice(*obj.__dlpack_device__())
    t.ndim = obj.ndim
    t.dtype = DLDataType(*obj.dlpack_dtype)
    t.shape = ctypes.cast(obj._c_shape, POINTER(ctypes.c_int64))
    t.strides = None
    t.byte_offset = 0
    return 0


@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, POINTER(c_void_p))
def _current_work_stream(device_type, device_id, out):
    stream_queries.append((device_type, device_id))
    out[0] = stream_handle(_current_stream) or None
    return 0


_API = _ExchangeAPI()
_API.header.version = DLPackVersion(1, 3)
_API.dltensor_from_py_object_no_sync = ctypes.cast(_dltensor_from_py_object, c_void_p).value
_API.current_work_stream = ctypes.cast(_current_work_stream, c_void_p).value
_API_NAME = ctypes.create_string_buffer(b"dlpack_exchange_api")


class FakeCudaTensor(FakeCudaArray):
    """A FakeCudaArray read through the DLPack C exchange API, like a torch CUDA tensor."""

    __dlpack_c_exchange_api__ = _capsule_new(ctypes.addressof(_API),
                                             ctypes.addressof(_API_NAME), None)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._c_shape = (ctypes.c_int64 * max(self.ndim, 1))(*self.shape)
