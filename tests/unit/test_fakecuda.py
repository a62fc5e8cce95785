"""The fake CUDA runtime (tests/support/fakecuda) that lets the GPU code paths run without a GPU."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from ctypes import byref, c_int, c_void_p
from pathlib import Path

import fakecuda
import numpy as np
import pytest
from fakecuda import (
    DEVICE_TO_DEVICE,
    DEVICE_TO_HOST,
    HOST_TO_DEVICE,
    MEMCPY_DEFAULT,
    FakeCudaArray,
    Stream,
)

SLOW_US = 200_000  # long enough that nothing finishes "by accident" before we look


@pytest.fixture(autouse=True)
def _idle():
    """Each test starts and ends with every stream idle and the counters at zero."""
    fakecuda.quiesce()
    fakecuda.reset_counters()
    yield
    fakecuda.quiesce()


@pytest.fixture
def cuda():
    return fakecuda.lib()


def device_alloc(cuda, n: int) -> int:
    p = c_void_p()
    fakecuda.check(cuda.cudaMalloc(byref(p), n))
    return p.value


def host_alloc(cuda, n: int) -> int:
    p = c_void_p()
    fakecuda.check(cuda.cudaHostAlloc(byref(p), n, 0))
    return p.value


def read(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


def device_with(cuda, data: bytes) -> int:
    """A device allocation holding `data`."""
    ptr = device_alloc(cuda, len(data))
    ctypes.memmove(ptr, data, len(data))
    return ptr


# ---------------------------------------------------------------------------- copies and streams

def test_async_copy_is_stale_until_synchronized(cuda, monkeypatch):
    monkeypatch.setenv("FAKECUDA_COPY_DELAY_US", str(SLOW_US))
    src = device_with(cuda, b"new data")
    dst = np.zeros(8, np.uint8)
    with Stream() as s:
        fakecuda.check(cuda.cudaMemcpyAsync(dst.ctypes.data, src, 8, DEVICE_TO_HOST, s.handle))
        assert dst.tobytes() == bytes(8)  # returned at once: nothing copied yet
        assert not s.query()
        s.synchronize()
        assert s.query()
    assert dst.tobytes() == b"new data"
    c = fakecuda.counters()
    assert (c["d2h_copies"], c["d2h_bytes"], c["pageable_async_copies"]) == (1, 8, 1)
    assert (c["stream_syncs"], c["h2d_copies"], c["bad_copies"]) == (1, 0, 0)
    fakecuda.check(cuda.cudaFree(src))


def test_pinned_copies_and_allocation_counters(cuda):
    dev = device_alloc(cuda, 16)
    pinned = host_alloc(cuda, 16)
    ctypes.memmove(pinned, b"0123456789abcdef", 16)
    fakecuda.check(cuda.cudaMemcpyAsync(dev, pinned, 16, HOST_TO_DEVICE, None))
    fakecuda.check(cuda.cudaMemcpyAsync(pinned, dev + 8, 8, DEVICE_TO_HOST, 2))  # per-thread
    fakecuda.check(cuda.cudaStreamSynchronize(1))  # DLPack's name for the legacy stream
    assert read(pinned, 16) == b"89abcdef89abcdef"
    fakecuda.check(cuda.cudaFreeHost(pinned))
    fakecuda.check(cuda.cudaFree(dev))
    c = fakecuda.counters()
    assert c["pageable_async_copies"] == 0
    assert (c["h2d_copies"], c["h2d_bytes"], c["d2h_copies"], c["d2h_bytes"]) == (1, 16, 1, 8)
    assert (c["host_allocs"], c["host_frees"], c["device_allocs"], c["device_frees"]) == (
        1, 1, 1, 1)


def test_memcpy_is_synchronous(cuda, monkeypatch):
    monkeypatch.setenv("FAKECUDA_COPY_DELAY_US", "50000")
    src = device_with(cuda, b"abcd")
    dst = ctypes.create_string_buffer(4)
    fakecuda.check(cuda.cudaMemcpy(dst, src, 4, MEMCPY_DEFAULT))
    assert dst.raw == b"abcd"
    assert fakecuda.counters()["d2h_copies"] == 1
    assert fakecuda.counters()["pageable_async_copies"] == 0  # counts async copies only
    fakecuda.check(cuda.cudaFree(src))


def test_copies_are_checked_against_their_kind(cuda):
    dev = device_alloc(cuda, 8)
    other = device_alloc(cuda, 8)
    host = ctypes.create_string_buffer(8)
    h = ctypes.addressof(host)
    cases = [
        (h, h, DEVICE_TO_HOST),         # source is not device memory
        (dev, dev, DEVICE_TO_HOST),     # destination is
        (h, h, HOST_TO_DEVICE),         # destination is not
        (dev, other, HOST_TO_DEVICE),   # source is
        (h, dev, DEVICE_TO_DEVICE),             # both must be device memory
        (dev + 4, other, DEVICE_TO_DEVICE),     # runs past the end of dst's allocation
        (dev, h, 9),                    # no such kind
    ]
    for dst, src, kind in cases:
        assert cuda.cudaMemcpyAsync(dst, src, 8, kind, None) == fakecuda.INVALID_VALUE
    assert cuda.cudaGetLastError() == fakecuda.INVALID_VALUE
    assert cuda.cudaGetLastError() == 0  # reading it clears it
    assert fakecuda.error_string(1) == "invalid argument"
    # cudaMemcpyDefault infers the direction from the pointers
    for dst, src in [(h, dev), (dev, h), (other, dev)]:
        fakecuda.check(cuda.cudaMemcpyAsync(dst, src, 8, MEMCPY_DEFAULT, None))
    fakecuda.check(cuda.cudaDeviceSynchronize())
    c = fakecuda.counters()
    assert c["bad_copies"] == len(cases)
    assert (c["d2h_copies"], c["h2d_copies"], c["d2d_copies"], c["device_syncs"]) == (1, 1, 1, 1)
    for p in (dev, other):
        fakecuda.check(cuda.cudaFree(p))
    assert cuda.cudaFree(h) == fakecuda.INVALID_VALUE  # not a device allocation


def test_streams_run_in_order_and_independently(cuda):
    dev = device_alloc(cuda, 4)
    with Stream() as slow, Stream() as fast:
        fakecuda.launch_write(slow, dev, b"slow", SLOW_US)
        fakecuda.launch_write(slow, dev, b"last")  # FIFO: after the slow one
        out = np.zeros(4, np.uint8)
        fakecuda.launch_write(fast, out.ctypes.data, b"fast")
        fast.synchronize()  # does not wait for the other stream
        assert out.tobytes() == b"fast"
        assert not slow.query()
        slow.synchronize()
    assert read(dev, 4) == b"last"
    assert fakecuda.counters()["d2h_copies"] == 0  # kernels are not copies
    fakecuda.check(cuda.cudaFree(dev))


def test_events_order_streams(cuda):
    dev = device_with(cuda, b"old!")
    out = np.zeros(4, np.uint8)
    with Stream() as producer, Stream() as consumer, Stream() as idle:
        fakecuda.launch_write(producer, dev, b"new!", SLOW_US)
        ev = fakecuda.Event()
        assert ev.query()  # never recorded: complete
        ev.record(producer)
        assert not ev.query()
        ev.wait(consumer)
        ev.record(idle)  # re-recording does not change what consumer already waits for
        fakecuda.check(cuda.cudaMemcpyAsync(out.ctypes.data, dev, 4, DEVICE_TO_HOST,
                                            consumer.handle))
        consumer.synchronize()
        assert out.tobytes() == b"new!"

        # without the wait the consumer reads stale data; the re-recorded event is on `idle`
        ctypes.memmove(dev, b"old!", 4)
        fakecuda.launch_write(producer, dev, b"new!", SLOW_US)
        ev.synchronize()
        assert ev.query()
        fakecuda.check(cuda.cudaMemcpyAsync(out.ctypes.data, dev, 4, DEVICE_TO_HOST,
                                            consumer.handle))
        consumer.synchronize()
        assert out.tobytes() == b"old!"
        ev.record(producer)
        ev.destroy()  # with its record pending, as CUDA allows
        producer.synchronize()
    c = fakecuda.counters()
    assert (c["stream_wait_events"], c["event_syncs"], c["events_created"]) == (1, 1, 1)
    assert c["streams_created"] == 3
    fakecuda.check(cuda.cudaFree(dev))


def test_legacy_stream_synchronizes_with_blocking_streams(cuda):
    dev = device_with(cuda, b"old!")
    out = np.zeros(4, np.uint8)
    for flags, expected in [(0, b"new!"), (1, b"old!")]:  # blocking, non-blocking
        ctypes.memmove(dev, b"old!", 4)
        with Stream(flags) as s:
            fakecuda.launch_write(s, dev, b"new!", SLOW_US)
            fakecuda.check(cuda.cudaMemcpyAsync(out.ctypes.data, dev, 4, DEVICE_TO_HOST, None))
            fakecuda.check(cuda.cudaStreamSynchronize(None))
            assert out.tobytes() == expected, flags
        fakecuda.quiesce()
    fakecuda.check(cuda.cudaFree(dev))


def test_devices_handles_and_versions(cuda, monkeypatch):
    n = c_int()
    fakecuda.check(cuda.cudaGetDeviceCount(byref(n)))
    assert n.value == 2
    monkeypatch.setenv("FAKECUDA_DEVICES", "4")
    fakecuda.check(cuda.cudaGetDeviceCount(byref(n)))
    assert n.value == 4
    fakecuda.check(cuda.cudaSetDevice(3))
    assert cuda.cudaSetDevice(4) == fakecuda.INVALID_DEVICE
    assert current_device(cuda) == 3
    seen = []
    thread = threading.Thread(target=lambda: seen.append(current_device(cuda)))
    thread.start()
    thread.join()
    assert seen == [0]  # the current device is per thread
    fakecuda.check(cuda.cudaSetDevice(0))
    fakecuda.check(cuda.cudaRuntimeGetVersion(byref(n)))
    assert n.value == 12080
    fakecuda.check(cuda.cudaDriverGetVersion(byref(n)))
    assert n.value == 12080
    s = Stream()
    s.destroy()
    assert cuda.cudaStreamSynchronize(s.handle) == fakecuda.INVALID_RESOURCE_HANDLE
    assert cuda.cudaStreamDestroy(None) == fakecuda.INVALID_RESOURCE_HANDLE
    assert cuda.cudaEventQuery(s.handle) == fakecuda.INVALID_RESOURCE_HANDLE


def current_device(cuda) -> int:
    dev = c_int()
    fakecuda.check(cuda.cudaGetDevice(byref(dev)))
    return dev.value


def test_quiesce_and_free_wait_for_pending_work(cuda):
    dev = device_alloc(cuda, 4)
    with Stream() as s:
        fakecuda.launch_write(s, dev, b"late", SLOW_US)
        fakecuda.quiesce()
        assert s.query()
        assert read(dev, 4) == b"late"
        fakecuda.launch_write(s, dev, b"late", SLOW_US)
        fakecuda.check(cuda.cudaFree(dev))  # waits for the write rather than racing it
    assert fakecuda.counters()["device_syncs"] == 0


def test_process_may_exit_with_streams_busy():
    # a write still sleeping on a live stream, into memory nothing frees (freeing would wait)
    code = ("import ctypes, fakecuda\n"
            "p = ctypes.c_void_p()\n"
            "fakecuda.check(fakecuda.lib().cudaMalloc(ctypes.byref(p), 8))\n"
            "fakecuda.launch_write(fakecuda.Stream(), p.value, b'12345678', 30_000_000)\n"
            "keep = fakecuda.Stream()\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[1] / "support")
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 20  # did not wait for the write


def test_concurrent_builds_agree(tmp_path):
    with ThreadPoolExecutor(6) as pool:
        paths = set(pool.map(lambda _: fakecuda._build_into(tmp_path), range(6)))
    assert len(paths) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths.pop().name]  # no temporaries left


# ---------------------------------------------------------------------------- DLPack

_get_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_get_pointer.restype, _get_pointer.argtypes = c_void_p, [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi["PyCapsule_SetName"]
_set_name.restype, _set_name.argtypes = c_int, [ctypes.py_object, ctypes.c_char_p]
_USED = ctypes.create_string_buffer(b"used_dltensor")  # must outlive the capsule


def managed_of(capsule, versioned=True):
    name = b"dltensor_versioned" if versioned else b"dltensor"
    kind = fakecuda.DLManagedTensorVersioned if versioned else fakecuda.DLManagedTensor
    return kind.from_address(_get_pointer(capsule, name))


def test_dlpack_export_fields():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = FakeCudaArray.from_numpy(arr, device=1)
    assert x.__dlpack_device__() == (2, 1)
    np.testing.assert_array_equal(x.to_numpy(), arr)
    cap = x.__dlpack__(max_version=(1, 1))
    m = managed_of(cap)
    t = m.dl_tensor
    assert (m.version.major, m.version.minor, m.flags) == (1, 0, 0)
    assert (t.device.device_type, t.device.device_id) == (2, 1)
    assert t.data == x.ptr and t.byte_offset == 0
    assert (t.ndim, t.shape[0], t.shape[1], t.strides[0], t.strides[1]) == (2, 2, 3, 3, 1)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)
    legacy = x.__dlpack__()
    assert managed_of(legacy, versioned=False).dl_tensor.data == x.ptr
    bf16 = FakeCudaArray.from_numpy(np.zeros(3, np.uint16), dlpack_dtype=(4, 16, 1),
                                    device_type=fakecuda.KDL_CUDA_MANAGED)
    t = managed_of(bf16.__dlpack__(max_version=(1, 0))).dl_tensor
    assert (t.dtype.code, t.dtype.bits, t.device.device_type) == (4, 16, 13)
    flag = FakeCudaArray.from_numpy(np.array([True, False]))
    t = managed_of(flag.__dlpack__(max_version=(1, 0))).dl_tensor
    assert (t.dtype.code, t.dtype.bits) == (6, 8)
    assert x.exports == 2 and x.last_export_stream is None
    with pytest.raises(BufferError):
        x.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError):
        x.__dlpack__(copy=True)
    with pytest.raises(ValueError):
        x.__dlpack__(stream=0)


def test_dlpack_memory_lives_until_the_deleter_runs(cuda):
    x = FakeCudaArray.from_numpy(np.arange(4, dtype=np.int64))
    fakecuda.check(fakecuda.lib().cudaDeviceSynchronize())  # the write lands before we read
    ptr = x.ptr
    unused = x.__dlpack__(max_version=(1, 0))
    taken = x.__dlpack__(max_version=(1, 0))
    assert x.live_exports == 2
    del unused  # never consumed: its destructor runs the deleter
    assert x.live_exports == 1
    # a consumer takes `taken`: renames it, and owes the deleter call
    m = managed_of(taken)
    assert _set_name(taken, _USED) == 0
    del taken
    assert x.live_exports == 1
    fakecuda.reset_counters()
    del x
    assert fakecuda.counters()["device_frees"] == 0  # the export still holds the memory
    np.testing.assert_array_equal(np.frombuffer(read(ptr, 32), np.int64), np.arange(4))
    ctypes.CFUNCTYPE(None, c_void_p)(m.deleter)(ctypes.addressof(m))
    assert fakecuda.live_exports() == 0
    assert fakecuda.counters()["device_frees"] == 1


def test_destructor_keeps_a_pending_exception():
    # The list and its capsule die while the IndexError is pending, as in a consumer's error
    # path; a destructor calling back into Python would turn the error into a SystemError.
    x = FakeCudaArray.from_numpy(np.ones(2))
    with pytest.raises(IndexError):
        [x.__dlpack__(max_version=(1, 0))][1]
    assert x.live_exports == 0


@pytest.mark.parametrize("producer_is_legacy", [False, True])
def test_dlpack_stream_makes_the_consumer_wait(cuda, producer_is_legacy):
    old, new = np.zeros(4, np.int32), np.arange(1, 5, dtype=np.int32)
    producer = None if producer_is_legacy else Stream()
    x = FakeCudaArray.from_numpy(old, stream=producer)
    out = np.zeros(4, np.int32)
    with Stream() as consumer:
        for export_stream, expected in [(consumer.handle, new), (-1, old)]:
            fakecuda.quiesce()
            ctypes.memmove(x.ptr, old.ctypes.data, old.nbytes)
            fakecuda.reset_counters()
            x.write(new, delay_us=SLOW_US)  # pending on the producer stream
            x.__dlpack__(stream=export_stream, max_version=(1, 0))
            assert x.last_export_stream == export_stream
            fakecuda.check(cuda.cudaMemcpyAsync(out.ctypes.data, x.ptr, out.nbytes,
                                                DEVICE_TO_HOST, consumer.handle))
            consumer.synchronize()
            np.testing.assert_array_equal(out, expected)
            assert fakecuda.counters()["stream_wait_events"] == (export_stream != -1)
    # the consumer on the producer's own stream needs no event
    fakecuda.reset_counters()
    x.__dlpack__(stream=1 if producer_is_legacy else producer.handle)
    assert fakecuda.counters()["stream_wait_events"] == 0
