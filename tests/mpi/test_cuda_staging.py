"""fastreduce's GPU paths, on CPU-only machines: over the fake CUDA runtime of
tests/support/fakecuda.

The fake's "device memory" is host memory and its streams are worker threads that
run copies and delayed writes in order, so everything fastreduce does with CUDA
memory can be checked here: results against the host path, the copies made (by
fastreduce's counters and, independently, the fake's), pinned-buffer reuse,
pipelined chunks, stream ordering, the CUDA-aware branch, and bad input.

Every case runs twice (profile fakecuda): with the progress engine (1, 2 and 4 ranks), and
with it off (engine.set_enabled(False), as FASTREDUCE_ENGINE=0; 2 ranks), where
non-blocking GPU calls keep to MPI's non-blocking collectives.
"""

from __future__ import annotations

import gc

import fakecuda
import numpy as np
import pytest
from fake_dlpack import FakeTensor
from fakecuda import FakeCudaArray, FakeCudaTensor, Stream
from mpi4py import MPI

import fastreduce
from fastreduce.backend import cudart as _cuda


@pytest.fixture(scope="module", autouse=True, params=[
    pytest.param("engine", id="engine",
                 marks=pytest.mark.mpi(ranks=(1, 2, 4), profile="fakecuda")),
    pytest.param("engine-off", id="engine-off",
                 marks=pytest.mark.mpi(ranks=(2,), profile="fakecuda")),
])
def not_cuda_aware(request):
    """Each case with and without the engine (off: non-blocking GPU calls keep to MPI's
    non-blocking collectives); the MPI declared not CUDA-aware for the module, the fake
    device quiet at its end."""
    from fastreduce.backend import engine

    fastreduce.set_cuda_aware(False)
    engine.set_enabled(None if request.param == "engine" else False)
    yield request.param
    fakecuda.quiesce()
    engine.set_enabled(None)
    fastreduce.set_cuda_aware(None)


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


STAGING_SLOTS = 4  # the pipeline's ring of pinned slots (src/fastreduce/backend/cudart.pxd)


def ring_bytes(nbytes: int) -> int:
    """The pinned memory a staged reduction of nbytes asks for: its chunks, up to the ring's
    slots."""
    chunk, count = _cuda.plan_staging(nbytes)
    return min(STAGING_SLOTS, count) * chunk


def counted(fn):
    """(fastreduce's copy counts, the fake runtime's) made by fn()."""
    fakecuda.quiesce()
    _cuda.reset_copy_counts()
    fakecuda.reset_counters()
    fn()
    fakecuda.quiesce()
    return _cuda.copy_counts(), fakecuda.counters()


@pytest.fixture(scope="module")
def producer() -> Stream:
    """A producer stream shared by the cases of every dtype and op."""
    return Stream()


@pytest.fixture
def gpu_path():
    """Sets fastreduce.gpupaths' device-pointer calls and GPU path; both back to the
    environment's after the case."""
    yield fastreduce.gpupaths
    fastreduce.gpupaths.set_device_pointer_calls(None)
    fastreduce.gpupaths.set_gpu_path(None)


# --- every dtype and op, every form, against the host path ---------------------------
SHAPES = [(0,), (1,), (1001,), (3, 5, 7)]
DTYPE_OPS = [pytest.param(name, op, id=f"{name}-{op}") for name in DTYPES
             for op in fastreduce.OP_NAMES if fastreduce.supports(name, op)]


@pytest.mark.parametrize("name, op", DTYPE_OPS)
def test_every_form_against_the_host_path(name, op, producer, comm, checks):
    """In place (__dlpack__ and the exchange API), new, out=, iallreduce_, iallreduce: the
    host path's result, for shapes (0,), (1,), (1001,), (3, 5, 7)."""
    check = checks.check
    for shape in SHAPES:
        n = int(np.prod(shape))
        values = rank_values(name, n, comm.rank).reshape(shape)
        want = host_result(name, op, values)
        what = f"{name} {op} {shape}"
        g = on_gpu(values, name, stream=producer)
        fastreduce.allreduce_(g, op)
        check(same(g.to_numpy(), want), f"in place {what}")
        g = on_gpu(values, name, cls=FakeCudaTensor, stream=producer)
        fakecuda.set_current_stream(producer)
        try:
            fastreduce.allreduce_(g, op)
        finally:
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


@pytest.mark.parametrize("name", ["int32", "float64", "float32"])
def test_sum_against_numpy(name, comm, checks):
    """An independent reference where exact: sums of small integers."""
    values = rank_values(name, 1001, comm.rank)
    g = on_gpu(values, name)
    fastreduce.allreduce_(g)
    want = sum(rank_values(name, 1001, r).astype(np.float64) for r in range(comm.size))
    checks.check(np.array_equal(g.to_numpy().astype(np.float64), want), f"{name} sum vs numpy")


# --- copies: counted by fastreduce and by the fake runtime ----------------------------
def test_one_copy_each_way(comm, checks):
    """One copy each way, through pinned memory, no whole-device synchronisation (counted by
    fastreduce and by the fake runtime)."""
    check = checks.check
    g = on_gpu(rank_values("float32", 1001, comm.rank), "float32")
    mine, fake = counted(lambda: fastreduce.allreduce_(g))
    check((mine["d2h_copies"], mine["h2d_copies"]) == (1, 1), f"one copy each way: {mine}")
    check((fake["d2h_copies"], fake["h2d_copies"]) == (1, 1), f"fake saw: {fake}")
    check(fake["pageable_async_copies"] == 0, "staging copies use pinned memory")
    check(fake["device_syncs"] == 0, "no whole-device synchronisation")
    check(fake["bad_copies"] == 0, "copies of the right kinds")


def test_pinned_buffers_reused(comm, checks):
    """Steady state: no pinned allocation per call, none per size below the largest seen;
    grown once for a larger call."""
    for n in (1, 100, 5000, 1001):
        fastreduce.allreduce_(on_gpu(rank_values("float64", n, comm.rank), "float64"))
    gs = [on_gpu(rank_values("float64", n, comm.rank), "float64")
          for n in (1, 100, 5000, 1001) * 10]
    mine, fake = counted(lambda: [fastreduce.allreduce_(x) for x in gs])
    checks.check(mine["pinned_allocs"] == 0 and fake["host_allocs"] == 0,
                 f"pinned buffers reused: {mine}, fake host_allocs {fake['host_allocs']}")
    # larger than all the pinned memory any rank holds now: 100_000 elements in a new
    # session (the cases that ran before this one in the session, of other files too, may
    # have grown it, and by different amounts on different ranks: every rank must call with
    # the same count, or MPI's behaviour is undefined; MPICH ends the job)
    held = comm.allreduce(_cuda.copy_counts()["pinned_bytes"], op=MPI.MAX)
    n = 100_000
    while ring_bytes(n * 8) <= held:
        n *= 2
    big = on_gpu(rank_values("float64", n, comm.rank), "float64")
    mine, fake = counted(lambda: fastreduce.allreduce_(big))
    checks.check(mine["pinned_allocs"] == 1 and fake["host_allocs"] == 1,
                 f"grown once for a larger call ({n} elements): {mine}, fake host_allocs "
                 f"{fake['host_allocs']}")


# --- pipelined chunks -------------------------------------------------------------------
@pytest.fixture
def staging_chunk():
    """Sets the staging chunk for the case (fastreduce's cudart.set_staging_chunk), then back
    to what it was."""
    old = _cuda.set_staging_chunk(0)
    _cuda.set_staging_chunk(old)
    yield _cuda.set_staging_chunk
    _cuda.set_staging_chunk(old)


@pytest.mark.parametrize("n", [3000, 513, 512], ids=["6-chunks", "4-byte-tail", "one-chunk"])
def test_chunked(n, staging_chunk, comm, checks):
    """4096-byte chunks: 6 (the ring of slots refilled), a 4-byte tail, exactly one chunk;
    one copy each way per chunk; avg, and the exchange API."""
    check = checks.check
    staging_chunk(4096)
    values = rank_values("float64", n, comm.rank)
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


@pytest.mark.parametrize("n", [3000, 2500])
def test_ring_slot_reuse_with_slow_copies_out(n, staging_chunk, monkeypatch, comm, checks):
    """Slow copies out: refilling a ring slot must wait until its copy out has read it."""
    staging_chunk(4096)
    monkeypatch.setenv("FAKECUDA_H2D_DELAY_US", "30000")
    values = rank_values("float64", n, comm.rank)
    g = on_gpu(values, "float64")
    fastreduce.allreduce_(g)
    checks.check(same(g.to_numpy(), host_result("float64", "sum", values)), f"ring reuse {n}")


def test_auto_chunked(comm, checks):
    """2.4 MB: the automatic plan pipelines it."""
    values = rank_values("float32", 600_000, comm.rank)
    g = on_gpu(values, "float32")
    mine, _ = counted(lambda: fastreduce.allreduce_(g))
    checks.check(same(g.to_numpy(), host_result("float32", "sum", values)),
                 "auto-chunked 2.4 MB")
    checks.check(mine["d2h_copies"] == _cuda.plan_staging(values.nbytes)[1] > 1,
                 f"auto chunks: {mine}")


# --- every form on pipelined shapes: the copies each form makes --------------------------------
# Blocking forms (in place, new, out=) pipeline large messages in plan_staging's chunks; the
# non-blocking ones too where the progress engine runs them, else they copy whole. "in_place"
# is blocking although it starts with an "i".
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


@pytest.mark.parametrize("name", ["float32", "int64", "float16", "uint8"])
def test_copies_of_every_form_pipelined(name, comm, checks):
    """Just over 4 MiB (the ring refilled, a ragged end), each form: the copies it makes
    (chunked where blocking or on the engine, whole otherwise), its result, x kept."""
    check = checks.check
    engine = fastreduce.backend.engine.state()[0]
    itemsize = DTYPES[name][0].itemsize
    shape = (3, (4 << 20) // itemsize // 3 + 7)  # just over 4 MiB: ring refilled, ragged end
    nbytes = int(np.prod(shape)) * itemsize
    nchunks = _cuda.plan_staging(nbytes)[1]
    check(nchunks > STAGING_SLOTS, f"{name} {shape}: {nchunks} chunks do not refill the ring")
    values = rank_values(name, int(np.prod(shape)), comm.rank).reshape(shape)
    want = host_result(name, "sum", values)
    for form, blocking in BLOCKING_FORMS.items():
        g = on_gpu(values, name)
        holder = []
        mine, fake = counted(lambda form=form, g=g, holder=holder: holder.append(
            reduce_by(form, g)))
        copies = nchunks if blocking or engine else 1
        check(mine["d2h_copies"] == mine["h2d_copies"] == fake["d2h_copies"] == copies
              and mine["d2h_bytes"] == mine["h2d_bytes"] == nbytes,
              f"{form} {name} {shape}: expected {copies} copies each way of {nbytes} bytes, "
              f"counted {mine}, fake {fake}")
        check(same(holder[0].to_numpy(), want), f"{form} {name} {shape}: result")
        if form in ("new", "out", "iallreduce"):
            check(same(g.to_numpy(), values), f"{form} {name} {shape}: x kept")


# --- stream ordering ----------------------------------------------------------------------
def ordering(form: str, cls, n: int, skip: bool, phase: int, rank: int, size: int) -> bool:
    """A "kernel" on the producer stream writes x just before the call: 20 ms, or 100 ms
    where the result must be stale (skip: without fastreduce's waits)."""
    stream = Stream()
    g = cls.from_numpy(np.zeros(n, np.float32), stream=stream)
    if cls is FakeCudaTensor:
        fakecuda.set_current_stream(stream)
    g.write(np.full(n, (rank + 1) * phase, np.float32),
            delay_us=100_000 if skip else 20_000)
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


# (class, form, n): each case writes values of its own phases, so that stale data from an
# earlier case can never pass for this one's result
ORDERING = [(cls, form, n) for cls in (FakeCudaArray, FakeCudaTensor)
            for form in ("in place", "new", "nonblocking") for n in (1000, 3000)]


@pytest.mark.parametrize("cls, form, n", [
    pytest.param(cls, form, n, id=f"{cls.__name__}-{form.replace(' ', '-')}-{n}")
    for cls, form, n in ORDERING])
def test_ordered_after_the_producer(cls, form, n, staging_chunk, comm, checks):
    """A "kernel" on the producer stream writes x just before the call: its values
    are what gets reduced (3000 elements: in 4096-byte chunks); without fastreduce's host
    waits they are not (on more than one rank)."""
    phase = 2 + 2 * ORDERING.index((cls, form, n))
    staging_chunk(4096 if n == 3000 else 0)
    checks.check(ordering(form, cls, n, False, phase, comm.rank, comm.size),
                 f"ordered: {cls.__name__} {form} {n}")
    if comm.size > 1:  # one rank's sum is its own value, which arrives in the end anyway
        checks.check(not ordering(form, cls, n, True, phase + 1, comm.rank, comm.size),
                     f"the ordering test cannot fail: {cls.__name__} {form} {n}")
    fakecuda.quiesce()


def test_results_ordered_on_the_frameworks_stream(comm, checks):
    """Exchange API: one host wait (for the copy in); the framework is asked for cuda:0's
    stream, and the host does not wait for the results."""
    stream = Stream()
    fakecuda.set_current_stream(stream)
    try:
        g = on_gpu(rank_values("float32", 1001, comm.rank), "float32", cls=FakeCudaTensor,
                   stream=stream)
        mine, _ = counted(lambda: fastreduce.allreduce_(g))
    finally:
        fakecuda.set_current_stream(None)
    checks.check(mine["event_syncs"] + mine["stream_syncs"] == 1,
                 f"exchange API: one host wait (for the copy in), got {mine}")
    checks.check(fakecuda.stream_queries[-1] == (2, 0), "asked the framework for cuda:0's stream")


def read_on(stream: Stream, g: FakeCudaArray) -> np.ndarray:
    """g's contents as work queued on `stream` sees them (that stream alone is waited for)."""
    out = np.empty(g.shape, g.dtype)
    fakecuda.check(fakecuda.lib().cudaMemcpyAsync(out.ctypes.data, g.ptr, g.nbytes,
                                                  fakecuda.DEVICE_TO_HOST, stream.handle))
    stream.synchronize()
    return out


@pytest.mark.parametrize("chunk", [0, 4096])
def test_results_before_later_work_on_the_frameworks_stream(chunk, staging_chunk, monkeypatch,
                                                            comm, checks):
    """Slow copies (unordered reads would see old data): work queued on the framework's
    stream after the call sees the results."""
    monkeypatch.setenv("FAKECUDA_COPY_DELAY_US", "20000")
    staging_chunk(chunk)
    stream = Stream()
    fakecuda.set_current_stream(stream)
    try:
        values = rank_values("float64", 3000, comm.rank)
        g = on_gpu(values, "float64", cls=FakeCudaTensor, stream=stream)
        fastreduce.allreduce_(g)
    finally:
        fakecuda.set_current_stream(None)
    checks.check(same(read_on(stream, g), host_result("float64", "sum", values)),
                 f"results ordered before later work on the framework's stream (chunk {chunk})")
    fakecuda.quiesce()


def test_dlpack_producer_waits_for_the_copy_back(comm, checks):
    """__dlpack__ producer: fastreduce waits for the copy back too, and passes its own stream
    to __dlpack__."""
    stream = Stream()
    g = on_gpu(rank_values("float32", 1001, comm.rank), "float32", stream=stream)
    mine, _ = counted(lambda: fastreduce.allreduce_(g))
    checks.check(mine["event_syncs"] + mine["stream_syncs"] == 2,
                 f"__dlpack__ producer: waits for the copy back too: {mine}")
    checks.check(g.last_export_stream not in (None, -1, 1, 2),
                 "passed fastreduce's stream to __dlpack__")


# --- the direct path: the device pointer goes to MPI, no copies --------------------------------
# (an MPI that promises blocking and non-blocking calls; which MPI promises what, and the
# automatic choice, are tests/mpi/test_gpu_paths.py's)
@pytest.fixture
def direct(gpu_path):
    """The direct path, on an MPI that promises blocking and non-blocking calls."""
    gpu_path.set_device_pointer_calls("blocking,nonblocking")
    gpu_path.set_gpu_path("direct")


@pytest.mark.parametrize("cls", [FakeCudaArray, FakeCudaTensor], ids=lambda c: c.__name__)
def test_direct(cls, direct, comm, checks):
    """The device pointer goes to MPI: no copies, after a wait for the producer's stream;
    iallreduce too."""
    values = rank_values("float32", 1001, comm.rank)
    g = on_gpu(values, "float32", cls=cls)
    mine, fake = counted(lambda g=g: fastreduce.allreduce_(g))
    checks.check(same(g.to_numpy(), host_result("float32", "sum", values)), "cuda-aware sum")
    checks.check(mine["d2h_copies"] + mine["h2d_copies"] == 0
                 == fake["d2h_copies"] + fake["h2d_copies"],
                 f"cuda-aware: no copies, counted {mine}, fake {fake}")
    checks.check(mine["stream_syncs"] >= 1, "cuda-aware: waited for the producer's stream")
    g = on_gpu(values, "float32", cls=cls)
    checks.check(same(fastreduce.iallreduce(g).wait().to_numpy(),
                      host_result("float32", "sum", values)), "cuda-aware iallreduce")


def test_direct_avg_is_staged(direct, comm, checks):
    """avg divides on the host: staged even with a CUDA-aware MPI."""
    values = rank_values("float32", 1001, comm.rank)
    g = on_gpu(values, "float32")
    mine, _ = counted(lambda: fastreduce.allreduce_(g, "avg"))
    checks.check(same(g.to_numpy(), host_result("float32", "avg", values)),
                 "cuda-aware avg (staged)")
    checks.check(mine["d2h_copies"] == 1,
                 "avg divides on the host: staged even with a CUDA-aware MPI")


def test_direct_ordered_after_the_producer(direct, comm, checks):
    """The direct path waits for the producer's stream (without that wait: stale data, on
    more than one rank)."""
    rank, size = comm.rank, comm.size
    for phase in (101, 102):
        n = 1000
        stream = Stream()
        g = FakeCudaArray.from_numpy(np.zeros(n, np.float32), stream=stream)
        g.write(np.full(n, (rank + 1) * phase, np.float32),
                delay_us=100_000 if phase == 102 else 20_000)
        _cuda._set_skip_waits(phase == 102)
        try:
            fastreduce.allreduce_(g)
        finally:
            _cuda._set_skip_waits(False)
        ok = bool(np.all(g.to_numpy() == sum(range(1, size + 1)) * phase))
        if phase == 101:
            checks.check(ok, "cuda-aware: ordered after the producer's stream")
        elif size > 1:
            checks.check(not ok, "cuda-aware: the ordering test cannot fail")


def test_managed_memory(comm, checks):
    """Managed memory: MPI reads it on the host once the producer is done, no copies."""
    values = rank_values("int64", 1001, comm.rank)
    g = FakeCudaArray.from_numpy(values, device_type=13, delay_us=100_000)
    mine, fake = counted(lambda: fastreduce.allreduce_(g))
    checks.check(same(g.to_numpy(), host_result("int64", "sum", values)), "managed memory")
    checks.check(mine["d2h_copies"] == 0 == fake["d2h_copies"], "managed memory: no copies")


@pytest.mark.parametrize("device_type", [3, 11], ids=["cuda-host", "rocm-host"])
def test_pinned_host_memory(device_type, comm, checks):
    """Pinned host memory (CUDA's or ROCm's) is host memory: the host path, no CUDA call."""
    values = rank_values("float32", 1001, comm.rank)
    a = values.copy()
    mine, fake = counted(lambda: fastreduce.allreduce_(FakeTensor(a, device=(device_type, 0))))
    checks.check(same(a, host_result("float32", "sum", values)),
                 f"pinned host memory ({device_type})")
    checks.check(mine["d2h_copies"] + mine["stream_syncs"] + mine["event_syncs"] == 0
                 and fake["d2h_copies"] == 0, f"pinned host memory ({device_type}): no CUDA calls")


# --- non-blocking: dropped requests, wait_all mixing host and GPU ------------------------------
def test_dropped_request_delivers(comm, checks):
    """A GPU request dropped without wait() still delivers its result."""
    values = rank_values("float64", 1001, comm.rank)
    want = host_result("float64", "sum", values)
    g = on_gpu(values, "float64")
    req = fastreduce.iallreduce_(g)
    del req
    gc.collect()
    fastreduce.backend.engine.wait_idle()  # with the engine, the dropped request finishes there
    checks.check(same(g.to_numpy(), want), "a dropped GPU request still delivers its result")


def test_wait_all_host_and_gpu(comm, checks):
    """wait_all mixing host and GPU requests, in place and not; iallreduce keeps x."""
    values = rank_values("float64", 1001, comm.rank)
    want = host_result("float64", "sum", values)
    h = values.copy()
    g = on_gpu(values, "float64")
    results = fastreduce.wait_all([fastreduce.iallreduce_(h), fastreduce.iallreduce(g, "max"),
                                   fastreduce.iallreduce_(on_gpu(values, "float64"))])
    checks.check(same(results[0], want) and same(results[2].to_numpy(), want)
                 and same(results[1].to_numpy(), host_result("float64", "max", values)),
                 "wait_all")
    checks.check(same(g.to_numpy(), values), "iallreduce keeps x")


# --- coalesced ---------------------------------------------------------------------------------
@pytest.mark.parametrize("aware", [False, True], ids=["staged", "cuda-aware"])
def test_coalesced(aware, gpu_path, comm, checks):
    """Tensors of several dtypes in one call: the host path's results; staged, 5 copies each
    way; CUDA-aware, none (but bfloat16's sum where that is fastreduce's own op)."""
    specs = [("float32", 10), ("float64", 7), ("int32", 0), ("float32", 1), ("bfloat16", 33),
             ("int32", 5)]
    arrays = [rank_values(name, n, comm.rank) for name, n in specs]
    gpu_path.set_device_pointer_calls("blocking" if aware else "none")
    gpu_path.set_gpu_path("direct")
    gpus = [on_gpu(a, name) for a, (name, _) in zip(arrays, specs, strict=True)]
    mine, fake = counted(lambda gpus=gpus: fastreduce.allreduce_coalesced_(gpus))
    for g, a, (name, _) in zip(gpus, arrays, specs, strict=True):
        checks.check(same(g.to_numpy(), host_result(name, "sum", a)),
                     f"coalesced {name} aware={aware}")
    copies = mine["d2h_copies"] + mine["h2d_copies"]
    # bfloat16's sum is fastreduce's own op, staged even with a CUDA-aware MPI
    own_bf16_op = "sum: fastreduce op" in fastreduce.half_precision_paths()["bfloat16"]
    expected = 2 * 5 if not aware else 2 * int(own_bf16_op)
    checks.check(copies == expected and fake["d2h_copies"] + fake["h2d_copies"] == expected,
                 f"coalesced aware={aware}: {copies} copies, expected {expected}")


# --- bad input: the rank that made it raises, nothing changes -------------------------------
def test_bad_input(comm, checks):
    """Tensors on different devices, or not on the current CUDA device: ValueError naming
    both, nothing changed."""
    expect = checks.expect
    x = on_gpu(rank_values("float32", 4, comm.rank), "float32")
    h = np.ones(4, np.float32)
    expect(ValueError, ["out is on cpu", "x is on cuda:0"],
           lambda: fastreduce.allreduce(x, out=h), x, h)
    expect(ValueError, ["out is on cuda:0", "x is on cpu"],
           lambda: fastreduce.allreduce(h, out=x), x, h)
    expect(ValueError, ["out is on cpu", "x is on cuda:0"],
           lambda: fastreduce.iallreduce(x, out=h), x, h)
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
def test_staging_plan(staging_chunk, checks):
    """plan_staging's chunks: whole up to 512 KiB, multiples of 4096 between 256 KiB and
    16 MiB covering the message exactly; broadcast, allgather, gather and alltoall whole up
    to 8 MiB; a fixed chunk size for every call; bad chunk sizes and calls refused."""
    check = checks.check
    check(_cuda.plan_staging(0) == (0, 0), "plan of nothing")
    for nbytes in (1, 16, 4096, 512 << 10):
        check(_cuda.plan_staging(nbytes) == (nbytes, 1), f"{nbytes} bytes go whole")
    check(_cuda.plan_staging(1 << 20) == (512 << 10, 2), "1 MiB: 2 chunks of 512 KiB")
    check(_cuda.plan_staging(256 << 20) == (8 << 20, 32), "256 MiB: 32 chunks of 8 MiB")
    check(_cuda.plan_staging(4 << 30) == (16 << 20, 256), "4 GiB: chunks capped at 16 MiB")
    for nbytes in ([(512 << 10) + 1, 3_000_017, 10**8 + 4, 1 << 33]
                   + [2**k + 8 for k in range(20, 34)]):
        chunk, count = _cuda.plan_staging(nbytes)
        check(chunk % 4096 == 0 and (256 << 10) <= chunk <= (16 << 20), f"chunk of {nbytes}")
        check((count - 1) * chunk < nbytes <= count * chunk, f"chunks cover {nbytes} exactly")
    for bad in (-16, 4097, 8):
        checks.expect(ValueError, ["multiple of 16"], lambda bad=bad: _cuda.set_staging_chunk(bad))
    # data movement: the calls that only move bytes go whole up to 8 MiB, the others as
    # the all-reduce
    for call in ("broadcast", "allgather", "gather", "alltoall"):
        for nbytes in (1 << 20, 8 << 20):
            check(_cuda.plan_staging(nbytes, call) == (nbytes, 1), f"{call} of {nbytes} whole")
        check(_cuda.plan_staging((8 << 20) + 16, call) == _cuda.plan_staging((8 << 20) + 16)
              and _cuda.plan_staging(64 << 20, call) == (4 << 20, 16),
              f"{call} above 8 MiB pipelined as the all-reduce")
    for call in ("reduce", "reduce_scatter", "scatter"):
        check(_cuda.plan_staging(1 << 20, call) == (512 << 10, 2), f"{call} of 1 MiB")
    checks.expect(ValueError, ["call 'bcast'", "alltoall, broadcast"],
                  lambda: _cuda.plan_staging(1 << 20, "bcast"))
    staging_chunk(4096)
    check(_cuda.plan_staging(10_000) == (4096, 3) and _cuda.plan_staging(100) == (100, 1),
          "fixed chunk size")
    check(_cuda.plan_staging(10_000, "broadcast") == (4096, 3), "fixed chunk: every call")


def test_runtime_info(checks):
    """runtime_info names the loaded runtime (the fake's path) and its version."""
    info = _cuda.runtime_info()
    checks.check(info["path"] is not None and info["version"] == "12.8", f"runtime_info: {info}")
