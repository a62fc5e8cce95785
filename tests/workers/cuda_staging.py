"""fastreduce's GPU paths over the fake CUDA runtime of tests/fakecuda.

The fake's "device memory" is host memory and its streams are worker threads that
run copies and delayed writes in order, so everything fastreduce does with CUDA
memory can be checked here: results against the host path, the copies made (by
fastreduce's counters and, independently, the fake's), pinned-buffer reuse,
pipelined chunks, stream ordering, the CUDA-aware branch, and bad input. Needs
FASTREDUCE_CUDART pointing at the fake library.
"""

from __future__ import annotations

import gc
import os

import fakecuda
import numpy as np
from common import WORLD, Failures
from fake_dlpack import FakeTensor
from fakecuda import FakeCudaArray, FakeCudaTensor, Stream

import fastreduce
from fastreduce.backend import cudart as _cuda

fails = Failures()
check, expect = fails.check, fails.expect
rank, size = WORLD.rank, WORLD.size
fastreduce.set_cuda_aware(False)

BF16 = (4, 16, 1)
# dtype name -> (numpy dtype holding the bits, DLPack dtype or None)
DTYPES = {name: (np.dtype(name), None) for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64",
    "complex64", "complex128")}
DTYPES["bfloat16"] = (np.dtype(np.uint16), BF16)


def rank_values(name: str, n: int, r: int) -> np.ndarray:
    """Small values of rank r (exact in every dtype; bfloat16 as its bit patterns)."""
    base = (np.arange(n) * 7 + r * 3) % 5
    if name == "bool":
        return base % 2 == 1
    if name == "bfloat16":  # 1.0 .. 5.0 as bfloat16 bits (float32's top half)
        return (np.float32(base + 1).view(np.uint32) >> 16).astype(np.uint16)
    return (base + 1).astype(DTYPES[name][0])


def host_result(name: str, op: str, values: np.ndarray) -> np.ndarray:
    """The host path's answer for the same input: the reference for the GPU paths."""
    a = values.copy()
    _, dl = DTYPES[name]
    fastreduce.allreduce_(FakeTensor(a, dtype=dl) if dl else a, op)
    return a


def on_gpu(values: np.ndarray, name: str, cls=FakeCudaArray, stream=None, delay_us=0):
    return cls.from_numpy(values, stream=stream, delay_us=delay_us,
                          dlpack_dtype=DTYPES[name][1])


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and got.tobytes() == want.tobytes()


# --- every dtype and op, every form, against the host path ---------------------------
SHAPES = [(0,), (1,), (1001,), (3, 5, 7)]
producer = Stream()
for name in DTYPES:
    for op in fastreduce.OP_NAMES:
        if not fastreduce.supports(name, op):
            continue
        for shape in SHAPES:
            n = int(np.prod(shape))
            values = rank_values(name, n, rank).reshape(shape)
            want = host_result(name, op, values)
            what = f"{name} {op} {shape}"
            g = on_gpu(values, name, stream=producer)
            fastreduce.allreduce_(g, op)
            check(same(g.to_numpy(), want), f"in place {what}")
            g = on_gpu(values, name, cls=FakeCudaTensor, stream=producer)
            fakecuda.set_current_stream(producer)
            fastreduce.allreduce_(g, op)
            fakecuda.set_current_stream(None)
            check(same(g.to_numpy(), want), f"in place (exchange API) {what}")
            g = on_gpu(values, name)
            r = fastreduce.allreduce(g, op)
            check(isinstance(r, FakeCudaArray) and same(r.to_numpy(), want), f"new {what}")
            check(same(g.to_numpy(), values), f"x kept {what}")
            out = fakecuda.empty_like(g)
            check(fastreduce.allreduce(g, op, out=out) is out and same(out.to_numpy(), want),
                  f"out= {what}")
            g = on_gpu(values, name)
            check(fastreduce.iallreduce_(g, op).wait() is g and same(g.to_numpy(), want),
                  f"iallreduce_ {what}")
            g = on_gpu(values, name)
            check(same(fastreduce.iallreduce(g, op).wait().to_numpy(), want),
                  f"iallreduce {what}")

# independent references where exact: sums of small integers
for name in ("int32", "float64", "float32"):
    values = rank_values(name, 1001, rank)
    g = on_gpu(values, name)
    fastreduce.allreduce_(g)
    want = sum(rank_values(name, 1001, r).astype(np.float64) for r in range(size))
    check(np.array_equal(g.to_numpy().astype(np.float64), want), f"{name} sum vs numpy")


# --- copies: counted by fastreduce and by the fake runtime ----------------------------
def counted(fn):
    """(fastreduce's copy counts, the fake runtime's) made by fn()."""
    fakecuda.quiesce()
    _cuda.reset_copy_counts()
    fakecuda.reset_counters()
    fn()
    fakecuda.quiesce()
    return _cuda.copy_counts(), fakecuda.counters()


values = rank_values("float32", 1001, rank)
g = on_gpu(values, "float32")
mine, fake = counted(lambda: fastreduce.allreduce_(g))
check((mine["d2h_copies"], mine["h2d_copies"]) == (1, 1), f"one copy each way: {mine}")
check((fake["d2h_copies"], fake["h2d_copies"]) == (1, 1), f"fake saw: {fake}")
check(fake["pageable_async_copies"] == 0, "staging copies use pinned memory")
check(fake["device_syncs"] == 0, "no whole-device synchronisation")
check(fake["bad_copies"] == 0, "copies of the right kinds")

# steady state: no pinned allocation per call, none per size below the largest seen
for n in (1, 100, 5000, 1001):
    fastreduce.allreduce_(on_gpu(rank_values("float64", n, rank), "float64"))
gs = [on_gpu(rank_values("float64", n, rank), "float64") for n in (1, 100, 5000, 1001) * 10]
mine, fake = counted(lambda: [fastreduce.allreduce_(x) for x in gs])
check(mine["pinned_allocs"] == 0 and fake["host_allocs"] == 0,
      f"pinned buffers reused: {mine}, fake host_allocs {fake['host_allocs']}")
big = on_gpu(rank_values("float64", 100_000, rank), "float64")
mine, fake = counted(lambda: fastreduce.allreduce_(big))
check(mine["pinned_allocs"] == 1 and fake["host_allocs"] == 1, "grown once for a larger call")

# --- pipelined chunks -------------------------------------------------------------------
old = _cuda.set_staging_chunk(4096)
for n in (3000, 513, 512):  # 6 chunks (ring refilled), a 4-byte tail, exactly one chunk
    values = rank_values("float64", n, rank)
    want = host_result("float64", "sum", values)
    nchunks = _cuda.plan_staging(n * 8)[1]
    g = on_gpu(values, "float64")
    mine, fake = counted(lambda g=g: fastreduce.allreduce_(g))
    check(same(g.to_numpy(), want), f"chunked {n}")
    check(mine["d2h_copies"] == mine["h2d_copies"] == fake["d2h_copies"] == nchunks,
          f"{n} elements: {nchunks} chunks expected, counted {mine}, fake {fake}")
    g = on_gpu(values, "float64")
    check(same(fastreduce.allreduce(g, "avg").to_numpy(), host_result("float64", "avg", values)),
          f"chunked avg {n}")
    g = on_gpu(values, "float64", cls=FakeCudaTensor)
    fastreduce.allreduce_(g)
    check(same(g.to_numpy(), want), f"chunked, exchange API {n}")
# slow copies out: refilling a ring slot must wait until its copy out has read it
os.environ["FAKECUDA_H2D_DELAY_US"] = "30000"
for n in (3000, 2500):
    values = rank_values("float64", n, rank)
    g = on_gpu(values, "float64")
    fastreduce.allreduce_(g)
    check(same(g.to_numpy(), host_result("float64", "sum", values)), f"ring reuse {n}")
del os.environ["FAKECUDA_H2D_DELAY_US"]
_cuda.set_staging_chunk(old)
values = rank_values("float32", 600_000, rank)  # 2.4 MB: the automatic plan pipelines it
g = on_gpu(values, "float32")
mine, _ = counted(lambda: fastreduce.allreduce_(g))
check(same(g.to_numpy(), host_result("float32", "sum", values)), "auto-chunked 2.4 MB")
check(mine["d2h_copies"] == _cuda.plan_staging(values.nbytes)[1] > 1, f"auto chunks: {mine}")


# --- every form on pipelined shapes: the copies each form makes --------------------------------
# Blocking forms (in place, new, out=) pipeline large messages in plan_staging's chunks; the
# non-blocking ones too where the progress engine runs them, else they copy whole. "in_place"
# is blocking although it starts with an "i".
ENGINE = fastreduce.backend.engine.state()[0]
STAGING_SLOTS = 4  # the pipeline's ring of pinned slots (src/fastreduce/_cuda.pxd)
BLOCKING_FORMS = {"in_place": True, "new": True, "out": True, "iallreduce_": False,
                  "iallreduce": False}


def reduce_by(form: str, g: FakeCudaArray):
    """fastreduce's call of one form on g; returns what holds the result."""
    if form == "in_place":
        return fastreduce.allreduce_(g)
    if form == "new":
        return fastreduce.allreduce(g)
    if form == "out":
        return fastreduce.allreduce(g, out=fakecuda.empty_like(g))
    if form == "iallreduce_":
        return fastreduce.iallreduce_(g).wait()
    return fastreduce.wait_all([fastreduce.iallreduce(g)])[0]


for name in ("float32", "int64", "float16", "uint8"):
    itemsize = DTYPES[name][0].itemsize
    shape = (3, (4 << 20) // itemsize // 3 + 7)  # just over 4 MiB: ring refilled, ragged end
    nbytes = int(np.prod(shape)) * itemsize
    nchunks = _cuda.plan_staging(nbytes)[1]
    check(nchunks > STAGING_SLOTS, f"{name} {shape}: {nchunks} chunks do not refill the ring")
    values = rank_values(name, int(np.prod(shape)), rank).reshape(shape)
    want = host_result(name, "sum", values)
    for form, blocking in BLOCKING_FORMS.items():
        g = on_gpu(values, name)
        holder = []
        mine, fake = counted(lambda form=form, g=g, holder=holder: holder.append(
            reduce_by(form, g)))
        copies = nchunks if blocking or ENGINE else 1
        check(mine["d2h_copies"] == mine["h2d_copies"] == fake["d2h_copies"] == copies
              and mine["d2h_bytes"] == mine["h2d_bytes"] == nbytes,
              f"{form} {name} {shape}: expected {copies} copies each way of {nbytes} bytes, "
              f"counted {mine}, fake {fake}")
        check(same(holder[0].to_numpy(), want), f"{form} {name} {shape}: result")
        if form in ("new", "out", "iallreduce"):
            check(same(g.to_numpy(), values), f"{form} {name} {shape}: x kept")


# --- stream ordering ----------------------------------------------------------------------
def ordering(form: str, cls, n: int, skip: bool, phase: int) -> bool:
    """A 200 ms "kernel" on the producer stream writes x just before the call."""
    stream = Stream()
    g = cls.from_numpy(np.zeros(n, np.float32), stream=stream)
    if cls is FakeCudaTensor:
        fakecuda.set_current_stream(stream)
    g.write(np.full(n, (rank + 1) * phase, np.float32), delay_us=200_000)
    _cuda._set_skip_waits(skip)
    try:
        if form == "in place":
            result = fastreduce.allreduce_(g)
        elif form == "new":
            result = fastreduce.allreduce(g)
        else:
            result = fastreduce.iallreduce_(g).wait()
    finally:
        _cuda._set_skip_waits(False)
        fakecuda.set_current_stream(None)
    want = sum(range(1, size + 1)) * phase
    return bool(np.all(result.to_numpy() == want))


phase = 1
for cls in (FakeCudaArray, FakeCudaTensor):
    for form in ("in place", "new", "nonblocking"):
        for n in (1000, 3000):
            old = _cuda.set_staging_chunk(4096 if n == 3000 else 0)
            phase += 1
            check(ordering(form, cls, n, False, phase), f"ordered: {cls.__name__} {form} {n}")
            if size > 1:  # one rank's sum is its own value, which arrives in the end anyway
                phase += 1
                check(not ordering(form, cls, n, True, phase),
                      f"the ordering test cannot fail: {cls.__name__} {form} {n}")
            _cuda.set_staging_chunk(old)
            fakecuda.quiesce()

# results are ordered on the framework's stream; the host does not wait for them
stream = Stream()
fakecuda.set_current_stream(stream)
g = on_gpu(rank_values("float32", 1001, rank), "float32", cls=FakeCudaTensor, stream=stream)
mine, _ = counted(lambda: fastreduce.allreduce_(g))
fakecuda.set_current_stream(None)
check(mine["event_syncs"] + mine["stream_syncs"] == 1,
      f"exchange API: one host wait (for the copy in), got {mine}")
check(fakecuda.stream_queries[-1] == (2, 0), "asked the framework for cuda:0's stream")

def read_on(stream: Stream, g: FakeCudaArray) -> np.ndarray:
    """g's contents as work queued on `stream` sees them (that stream alone is waited for)."""
    out = np.empty(g.shape, g.dtype)
    fakecuda.check(fakecuda.lib().cudaMemcpyAsync(out.ctypes.data, g.ptr, g.nbytes,
                                                  fakecuda.DEVICE_TO_HOST, stream.handle))
    stream.synchronize()
    return out


os.environ["FAKECUDA_COPY_DELAY_US"] = "20000"  # slow copies: unordered reads see old data
for chunk in (0, 4096):
    old = _cuda.set_staging_chunk(chunk)
    stream = Stream()
    fakecuda.set_current_stream(stream)
    values = rank_values("float64", 3000, rank)
    g = on_gpu(values, "float64", cls=FakeCudaTensor, stream=stream)
    fastreduce.allreduce_(g)
    fakecuda.set_current_stream(None)
    check(same(read_on(stream, g), host_result("float64", "sum", values)),
          f"results ordered before later work on the framework's stream (chunk {chunk})")
    _cuda.set_staging_chunk(old)
del os.environ["FAKECUDA_COPY_DELAY_US"]
fakecuda.quiesce()

g = on_gpu(rank_values("float32", 1001, rank), "float32", stream=stream)
mine, _ = counted(lambda: fastreduce.allreduce_(g))
check(mine["event_syncs"] + mine["stream_syncs"] == 2,
      f"__dlpack__ producer: waits for the copy back too: {mine}")
check(g.last_export_stream not in (None, -1, 1, 2), "passed fastreduce's stream to __dlpack__")

# --- the direct path: the device pointer goes to MPI, no copies --------------------------------
# (an MPI that promises blocking and non-blocking calls; which MPI promises what, and the
# automatic choice, are tests/workers/gpu_paths.py's)
fastreduce.runtime.set_device_pointer_calls("blocking,nonblocking")
fastreduce.runtime.set_gpu_path("direct")
values = rank_values("float32", 1001, rank)
for cls in (FakeCudaArray, FakeCudaTensor):
    g = on_gpu(values, "float32", cls=cls)
    mine, fake = counted(lambda g=g: fastreduce.allreduce_(g))
    check(same(g.to_numpy(), host_result("float32", "sum", values)), "cuda-aware sum")
    check(mine["d2h_copies"] + mine["h2d_copies"] == 0 == fake["d2h_copies"] + fake["h2d_copies"],
          f"cuda-aware: no copies, counted {mine}, fake {fake}")
    check(mine["stream_syncs"] >= 1, "cuda-aware: waited for the producer's stream")
    g = on_gpu(values, "float32", cls=cls)
    check(same(fastreduce.iallreduce(g).wait().to_numpy(), host_result("float32", "sum", values)),
          "cuda-aware iallreduce")
g = on_gpu(values, "float32")
mine, _ = counted(lambda: fastreduce.allreduce_(g, "avg"))
check(same(g.to_numpy(), host_result("float32", "avg", values)), "cuda-aware avg (staged)")
check(mine["d2h_copies"] == 1, "avg divides on the host: staged even with a CUDA-aware MPI")
for phase in (101, 102):
    n = 1000
    stream = Stream()
    g = FakeCudaArray.from_numpy(np.zeros(n, np.float32), stream=stream)
    g.write(np.full(n, (rank + 1) * phase, np.float32), delay_us=200_000)
    _cuda._set_skip_waits(phase == 102)
    fastreduce.allreduce_(g)
    _cuda._set_skip_waits(False)
    ok = bool(np.all(g.to_numpy() == sum(range(1, size + 1)) * phase))
    if phase == 101:
        check(ok, "cuda-aware: ordered after the producer's stream")
    elif size > 1:
        check(not ok, "cuda-aware: the ordering test cannot fail")
fastreduce.runtime.set_device_pointer_calls(None)
fastreduce.runtime.set_gpu_path(None)

# managed memory: MPI reads it on the host once the producer is done
values = rank_values("int64", 1001, rank)
g = FakeCudaArray.from_numpy(values, device_type=13, delay_us=100_000)
mine, fake = counted(lambda: fastreduce.allreduce_(g))
check(same(g.to_numpy(), host_result("int64", "sum", values)), "managed memory")
check(mine["d2h_copies"] == 0 == fake["d2h_copies"], "managed memory: no copies")

# pinned host memory (CUDA's or ROCm's) is host memory: the host path, no CUDA involved
for device_type in (3, 11):
    values = rank_values("float32", 1001, rank)
    a = values.copy()
    mine, fake = counted(lambda a=a, t=device_type: fastreduce.allreduce_(
        FakeTensor(a, device=(t, 0))))
    check(same(a, host_result("float32", "sum", values)), f"pinned host memory ({device_type})")
    check(mine["d2h_copies"] + mine["stream_syncs"] + mine["event_syncs"] == 0
          and fake["d2h_copies"] == 0, f"pinned host memory ({device_type}): no CUDA calls")

# --- non-blocking: dropped requests, wait_all mixing host and GPU ------------------------------
values = rank_values("float64", 1001, rank)
want = host_result("float64", "sum", values)
g = on_gpu(values, "float64")
req = fastreduce.iallreduce_(g)
del req
gc.collect()
fastreduce.backend.engine.wait_idle()  # with the engine, the dropped request finishes there
check(same(g.to_numpy(), want), "a dropped GPU request still delivers its result")
h = values.copy()
g = on_gpu(values, "float64")
results = fastreduce.wait_all([fastreduce.iallreduce_(h), fastreduce.iallreduce(g, "max"),
                               fastreduce.iallreduce_(on_gpu(values, "float64"))])
check(same(results[0], want) and same(results[2].to_numpy(), want)
      and same(results[1].to_numpy(), host_result("float64", "max", values)), "wait_all")
check(same(g.to_numpy(), values), "iallreduce keeps x")

# --- coalesced ---------------------------------------------------------------------------------
specs = [("float32", 10), ("float64", 7), ("int32", 0), ("float32", 1), ("bfloat16", 33),
         ("int32", 5)]
arrays = [rank_values(name, n, rank) for name, n in specs]
for aware in (False, True):
    fastreduce.runtime.set_device_pointer_calls("blocking" if aware else "none")
    fastreduce.runtime.set_gpu_path("direct")
    gpus = [on_gpu(a, name) for a, (name, _) in zip(arrays, specs, strict=True)]
    mine, fake = counted(lambda gpus=gpus: fastreduce.allreduce_coalesced_(gpus))
    for g, a, (name, _) in zip(gpus, arrays, specs, strict=True):
        check(same(g.to_numpy(), host_result(name, "sum", a)), f"coalesced {name} aware={aware}")
    copies = mine["d2h_copies"] + mine["h2d_copies"]
    # bfloat16's sum is fastreduce's own op, staged even with a CUDA-aware MPI
    own_bf16_op = "sum: fastreduce op" in fastreduce.half_precision_paths()["bfloat16"]
    expected = 2 * 5 if not aware else 2 * int(own_bf16_op)
    check(copies == expected and fake["d2h_copies"] + fake["h2d_copies"] == expected,
          f"coalesced aware={aware}: {copies} copies, expected {expected}")
fastreduce.runtime.set_device_pointer_calls(None)
fastreduce.runtime.set_gpu_path(None)

# --- bad input: the rank that made it raises, nothing changes -------------------------------
x = on_gpu(rank_values("float32", 4, rank), "float32")
h = np.ones(4, np.float32)
expect(ValueError, ["out is on cpu", "x is on cuda:0"], lambda: fastreduce.allreduce(x, out=h),
       x, h)
expect(ValueError, ["out is on cuda:0", "x is on cpu"], lambda: fastreduce.allreduce(h, out=x),
       x, h)
expect(ValueError, ["out is on cpu", "x is on cuda:0"], lambda: fastreduce.iallreduce(x, out=h),
       x, h)
other = FakeCudaArray.from_numpy(np.ones(4, np.float32), device=1)
expect(ValueError, ["x is on cuda:1", "current CUDA device is cuda:0", "set_device"],
       lambda: fastreduce.allreduce_(other), other)
expect(ValueError, ["out is on cuda:1", "current CUDA device is cuda:0"],
       lambda: fastreduce.allreduce(x, out=other), x, other)
expect(ValueError, ["tensors[1] is on cuda:0", "tensors[0] on cpu"],
       lambda: fastreduce.allreduce_coalesced_([h, x]), h, x)
expect(ValueError, ["tensors[2] is on cuda:1", "current CUDA device"],
       lambda: fastreduce.allreduce_coalesced_([x, x, other]), x, other)

# --- the staging planner's arithmetic ----------------------------------------------------------
check(_cuda.plan_staging(0) == (0, 0), "plan of nothing")
for nbytes in (1, 16, 4096, 512 << 10):
    check(_cuda.plan_staging(nbytes) == (nbytes, 1), f"{nbytes} bytes go whole")
check(_cuda.plan_staging(1 << 20) == (512 << 10, 2), "1 MiB: 2 chunks of 512 KiB")
check(_cuda.plan_staging(256 << 20) == (8 << 20, 32), "256 MiB: 32 chunks of 8 MiB")
check(_cuda.plan_staging(4 << 30) == (16 << 20, 256), "4 GiB: chunks capped at 16 MiB")
previous = 0
for nbytes in [(512 << 10) + 1, 3_000_017, 10**8 + 4, 1 << 33] + [2**k + 8 for k in range(20, 34)]:
    chunk, count = _cuda.plan_staging(nbytes)
    check(chunk % 4096 == 0 and (256 << 10) <= chunk <= (16 << 20), f"chunk of {nbytes}")
    check((count - 1) * chunk < nbytes <= count * chunk, f"chunks cover {nbytes} exactly")
for bad in (-16, 4097, 8):
    expect(ValueError, ["multiple of 16"], lambda bad=bad: _cuda.set_staging_chunk(bad))
old = _cuda.set_staging_chunk(4096)
check(_cuda.plan_staging(10_000) == (4096, 3) and _cuda.plan_staging(100) == (100, 1),
      "fixed chunk size")
_cuda.set_staging_chunk(old)

info = _cuda.runtime_info()
check(info["path"] is not None and info["version"] == "12.8", f"runtime_info: {info}")
fakecuda.quiesce()
fails.finish()
