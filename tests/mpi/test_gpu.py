"""fastreduce on torch CUDA tensors (the staged path) on 2 and 4 ranks sharing the GPUs.

Needs torch with CUDA and a GPU; skipped otherwise. Run only these with
`mpiexec -n 2 python -m pytest tests/mpi -m gpu` (and -n 4).

Every rank selects cuda:(local_rank % device_count). A case parametrized "staged" forces
the staged path (set_cuda_aware(False): device -> pinned host on torch's current stream, MPI
on the host, host -> device; large messages pipelined in chunks): the MPI need not be
CUDA-aware, nothing hands it a device pointer. A case parametrized "as-detected" takes the
path fastreduce chooses for the MPI in use: with a CUDA-aware MPI, direct calls (no copies)
where it promises them and the size table says so, never a non-blocking one it does not
promise; with any other MPI, the staged path again.

  matrix      every dtype x op x shape x form: bit for bit what fastreduce's CPU path
              gives for the same input, and equal to an independent torch reference where
              that is exact; copies per call; out-of-place calls leave x alone
  chunked     the same for a 1 MiB tensor cut into 64 KiB chunks (set_staging_chunk)
  ordering    input written on a side stream behind a ~100 ms kernel is what gets reduced,
              and with fastreduce's host waits skipped (_set_skip_waits) it is not
  visible     a kernel queued on that stream right after the call sees the result
  counts      1 copy each way per call (nchunks pipelined), one host wait per chunk, no
              pinned allocation in steady state
  coalesced   allreduce_coalesced_ over mixed dtypes and shapes against the CPU path;
              a list mixing CPU and CUDA tensors is refused untouched
  bad_input   out= on the other device, another device's tensor, non-contiguous tensors
  layers      all_sum_reduce, nn.AllSumReduce, all_reduce: forward + backward vs CPU
  gradsync    GradientSync on a CUDA MLP against a CPU reference run
  gradsync_broadcast  GradientSync's broadcast of rank 0's CUDA parameters (2 ranks, staged)
  movement    broadcast_, reduce_, allgather, reduce_scatter, alltoall (equal and uneven),
              gather, scatter, send/recv, blocking and started: bit for bit the CPU path's
              result, small and pipelined in chunks; x written behind a long kernel on a
              side stream is what moves, and a kernel queued after the call sees the result

Both paths run matrix, ordering, visible, layers, gradsync and movement; the others
run staged.
"""

from __future__ import annotations

import functools
import math
import zlib

import numpy as np
import pytest
import torch
from models import MLP
from mpi4py import MPI

import fastreduce
import fastreduce.backend.cudart as frcuda
from fastreduce.nn import AllSumReduce

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(ranks=(2, 4)),
              pytest.mark.one_mpi]

WORLD = MPI.COMM_WORLD
p, rank = WORLD.size, WORLD.rank
DEV = torch.device("cpu")  # this rank's CUDA device, set by the cuda_device fixture

DTYPES = (torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128)
FLOATING = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
            torch.complex128}
FORMS = ("in_place", "new", "out", "iallreduce_", "iallreduce")
BLOCKING_FORMS = ("in_place", "new", "out")  # pipelined in chunks; the others copy whole
SMALL_SHAPES = ((0,), (), (1,), (1001,), (3, 5, 7))
STAGING_SLOTS = 4  # the staged pipeline's ring (src/fastreduce/_cuda.pxd)


@functools.cache
def _no_cuda_reason() -> str | None:
    """Why the GPU cases cannot run here, or None when they can (the same on every rank)."""
    if not torch.cuda.is_available():
        return (f"no usable CUDA device: torch {torch.__version__} (CUDA "
                f"{torch.version.cuda or 'none: a CPU build'}) says "
                f"torch.cuda.is_available() is False")
    return None


@pytest.fixture(scope="module", autouse=True)
def cuda_device() -> torch.device:
    """This rank's GPU, cuda:(local_rank % device_count), current for the module's cases;
    every case is skipped without one."""
    global DEV
    reason = _no_cuda_reason()
    if reason:
        pytest.skip(reason)
    torch.cuda.set_device(fastreduce.local_rank() % torch.cuda.device_count())
    DEV = torch.device("cuda", torch.cuda.current_device())
    return DEV


@pytest.fixture
def gpu_path(request):
    """"staged": set_cuda_aware(False), the staged path forced; "as-detected": the paths
    fastreduce chooses for this MPI. Gives the device-pointer support in force."""
    fastreduce.set_cuda_aware(False if request.param == "staged" else None)
    yield fastreduce.gpupaths.device_pointer_support()
    fastreduce.set_cuda_aware(None)


BOTH_PATHS = pytest.mark.parametrize("gpu_path", ["staged", "as-detected"], indirect=True)
STAGED = pytest.mark.parametrize("gpu_path", ["staged"], indirect=True)


@BOTH_PATHS
def test_cuda_runtime(checks, gpu_path, request):
    """set_cuda_aware(False) is in force when staged; the CUDA runtime loads at the first
    GPU call (rank 0 prints the GPU path settings and the devices)."""
    staged = request.node.callspec.params["gpu_path"] == "staged"
    if staged:
        checks.check(fastreduce.cuda_aware() == (False, "fastreduce.set_cuda_aware()"),
                     f"cuda_aware() is {fastreduce.cuda_aware()} after set_cuda_aware(False)")
    if rank == 0:
        print(f"GPU paths: {fastreduce.gpupaths.gpu_path_settings()}", flush=True)
    fastreduce.allreduce_(torch.ones(1, device=DEV))  # loads the CUDA runtime
    info = frcuda.runtime_info()
    checks.check(info["path"] is not None, f"runtime_info() after a GPU call: {info}")
    if rank == 0:
        print(f"{p} ranks on {fastreduce.local_size()} per node, {torch.cuda.device_count()} "
              f"GPU(s) ({torch.cuda.get_device_name(DEV)}); torch {torch.__version__} CUDA "
              f"{torch.version.cuda}; fastreduce loaded {info}", flush=True)


# --- inputs and references ----------------------------------------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ops_for(dtype: torch.dtype) -> list[str]:
    return [op for op in fastreduce.OP_NAMES if fastreduce.supports(dtype_name(dtype), op)]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_input(dtype: torch.dtype, op: str, shape: tuple, r: int, case,
               integral: bool) -> torch.Tensor:
    """Rank r's input of a case, on DEV; every rank can regenerate every rank's input.

    Integers: small values (no overflow in any reduction of up to 4 ranks), every bit
    pattern for bitwise ops. Floats: small integers when `integral` (exact sums,
    products and averages over 2 or 4 ranks), else uniform in (-1, 1) ((0.5, 1.5) for
    products, imaginary parts in (-0.5, 0.5)).
    """
    g = torch.Generator(device=DEV)
    g.manual_seed(seed_of(case, r))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, device=DEV, dtype=torch.uint8).bool()
    if dtype not in FLOATING:
        if op in ("band", "bor", "bxor"):
            raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), generator=g,
                                device=DEV, dtype=torch.uint8)
            return raw.view(dtype).reshape(shape)
        low, high = (-3, 3) if op == "prod" else (-20, 20)
        low = 0 if dtype == torch.uint8 else low
        return torch.randint(low, high + 1, shape, generator=g, device=DEV).to(dtype)
    if integral:
        bound = 3 if op == "prod" else 8
        real = torch.randint(-bound, bound + 1, shape, generator=g, device=DEV).double()
        imag = torch.randint(-bound, bound + 1, shape, generator=g, device=DEV).double()
    else:
        real = torch.rand(shape, generator=g, device=DEV, dtype=torch.float64)
        imag = torch.rand(shape, generator=g, device=DEV, dtype=torch.float64) - 0.5
        real = real + 0.5 if op == "prod" else 2 * real - 1
    value = torch.complex(real, imag) if dtype.is_complex else real
    return value.to(dtype)


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in a dtype where the reductions of these inputs do not round."""
    if t.dtype == torch.bool:
        return t
    if t.is_complex():
        return t.to(torch.complex128)
    if t.is_floating_point():
        return t.to(torch.float64)
    return t.to(torch.int64)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of one tensor per rank computed wide by torch, in their dtype."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        fn = {"band": torch.logical_and, "min": torch.logical_and, "bor": torch.logical_or,
              "max": torch.logical_or, "bxor": torch.logical_xor}[op]
    else:
        fn = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum,
              "max": torch.maximum, "band": torch.bitwise_and, "bor": torch.bitwise_or,
              "bxor": torch.bitwise_xor}[op]
    acc = wide(inputs[0])
    for t in inputs[1:]:
        acc = fn(acc, wide(t))
    if op == "avg":  # complex: each component divided, as fastreduce does
        acc = torch.complex(acc.real / p, acc.imag / p) if acc.is_complex() else acc / p
    return acc.to(dtype)


def exact(dtype: torch.dtype, op: str, integral: bool) -> bool:
    """Whether reference() gives fastreduce's result exactly (whatever MPI's order)."""
    if dtype not in FLOATING or op in ("min", "max"):
        return True
    if op == "avg" and p & (p - 1):  # a division by 3 rounds differently in float64
        return False
    return integral


def cpu_path(x_cpu: torch.Tensor, op: str, blocking: bool) -> torch.Tensor:
    """fastreduce's CPU path on a copy of x_cpu, making the MPI calls the staged path makes.

    The staged path reduces pinned host memory in place: in one call, or, for blocking
    calls above the pipelining threshold, one call per chunk of plan_staging(). Open MPI
    picks its algorithm (and so the order in which 3+ ranks' floats are combined) by
    message size, so these are the CPU calls whose result the GPU must equal bit for bit.
    """
    y = x_cpu.clone()
    if not blocking and not fastreduce.backend.engine.state()[0]:  # one MPI_Iallreduce
        return fastreduce.iallreduce_(y, op).wait()
    chunk, nchunks = frcuda.plan_staging(y.numel() * y.element_size())
    if nchunks <= 1:
        return fastreduce.allreduce_(y, op)
    flat, step = y.view(-1), chunk // y.element_size()
    for i in range(nchunks):
        fastreduce.allreduce_(flat[i * step:(i + 1) * step], op)
    return y


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of t's elements as integers (complex: both components)."""
    t = t.detach().reshape(-1)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if t.is_floating_point():
        t = t.view(_INT_OF_SIZE[t.element_size()])
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit patterns (compared on a's device)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(bits(a), bits(b.to(a.device))))


def check_same(checks, ok: bool, what, got: torch.Tensor, want: torch.Tensor) -> None:
    """checks.check(ok, ...), describing the difference only when there is one."""
    checks.check(ok, "" if ok else f"{what}: {describe(got, want)}")


def describe(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)}"
    g, w = got.detach().cpu().reshape(-1), want.detach().cpu().reshape(-1)
    bad = (g != w).nonzero().reshape(-1)
    if bad.numel() == 0:
        return "equal values, different bit patterns (signed zeros?)"
    at = bad[:3].tolist()
    return (f"{bad.numel()} of {g.numel()} elements differ, e.g. at {at}: got {g[at].tolist()} "
            f"want {w[at].tolist()}")


def same_kind(a, b) -> bool:
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            and a.device == b.device)


class Host:
    """A CUDA tensor for Checks.expect, which snapshots `.array` to see it unchanged."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def array(self) -> np.ndarray:
        return self.tensor.detach().cpu().numpy()


def call(checks, form: str, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce x with fastreduce in one of FORMS; returns the tensor that holds the result."""
    if form == "in_place":
        result = fastreduce.allreduce_(x, op)
        checks.check(result is x, f"allreduce_ returned {type(result)}, not x")
    elif form == "new":
        result = fastreduce.allreduce(x, op)
        checks.check(result is not x and same_kind(result, x),
                     f"allreduce: result is not a new tensor of x's type, dtype, shape, device "
                     f"({result.dtype} {list(result.shape)} on {result.device})")
    elif form == "out":
        out = torch.empty_like(x)
        result = fastreduce.allreduce(x, op, out=out)
        checks.check(result is out, "allreduce(out=) did not return out")
    elif form == "iallreduce_":
        req = fastreduce.iallreduce_(x, op)
        result = req.wait()
        checks.check(result is x and req.done, "iallreduce_(x).wait() did not return x")
    else:
        req = fastreduce.iallreduce(x, op)
        (result,) = fastreduce.wait_all([req])
        checks.check(result is not x and same_kind(result, x) and req.wait() is result,
                     "iallreduce: wait_all did not give a new tensor like x")
    return result


def expected_chunks(nbytes: int, blocking: bool) -> int:
    """Copies each way of a staged call: plan_staging's chunks (non-blocking without the
    progress engine: one)."""
    if nbytes == 0:
        return 0
    pipelined = blocking or fastreduce.backend.engine.state()[0]
    return frcuda.plan_staging(nbytes)[1] if pipelined else 1


def host_waits(counts: dict) -> int:
    """fastreduce's host-side waits for the GPU (stream or event synchronisations)."""
    return counts["event_syncs"] + counts["stream_syncs"]


def check_counts(checks, counts: dict, nbytes: int, copies: int, what,
                 waits: int | None) -> None:
    """A staged call moved nbytes each way in `copies` copies, waiting on the host `waits`
    times (one per chunk copied in: the copy in must be done before MPI reads it)."""
    ok = (counts["d2h_copies"], counts["d2h_bytes"], counts["h2d_bytes"]) == (copies, nbytes,
                                                                              nbytes)
    if nbytes:  # an empty request may queue a 0-byte copy out and wait once; not asserted
        ok = ok and counts["h2d_copies"] == copies
        ok = ok and (waits is None or host_waits(counts) == waits)
    checks.check(ok, f"{what}: copy counts {counts}, expected {copies} copies each way of "
                     f"{nbytes} bytes in all and {waits} host waits")


# --- a. every dtype x op x shape x form -------------------------------------------------

def staged_case(checks, support, dtype: torch.dtype, op: str, shape: tuple, form: str,
                integral: bool) -> None:
    case = (dtype_name(dtype), op, shape, form, integral)
    x = make_input(dtype, op, shape, rank, case, integral)
    nbytes = x.numel() * x.element_size()
    blocking = form in BLOCKING_FORMS
    want = cpu_path(x.cpu(), op, blocking)
    before = x.clone()
    fastreduce.gpupaths.reset_gpu_copy_counts()
    result = call(checks, form, x, op)
    counts = fastreduce.gpupaths.gpu_copy_counts()
    if counts["direct_calls"]:  # as-detected: the device pointer went to MPI
        checks.check(blocking or support.nonblocking,
                     f"{case}: a non-blocking call went direct; the MPI does not promise it "
                     f"({support.why})")
        checks.check(counts["d2h_copies"] == counts["h2d_copies"] == 0,
                     f"{case}: a direct call made copies: {counts}")
        want = fastreduce.allreduce_(before.cpu(), op) if blocking else want
    else:
        chunks = expected_chunks(nbytes, blocking)
        check_counts(checks, counts, nbytes, chunks, case, chunks)
    checks.check(result.device == DEV, f"{case}: result on {result.device}")
    if form not in ("in_place", "iallreduce_"):
        checks.check(same_bits(x, before), f"{case}: x was modified by an out-of-place call")
    check_same(checks, same_bits(result, want), f"{case}: differs from the CPU path", result,
               want)
    if exact(dtype, op, integral):
        ref = reference([make_input(dtype, op, shape, r, case, integral) for r in range(p)], op)
        check_same(checks, torch.equal(result, ref), f"{case}: differs from the reference",
                   result, ref)


def run_matrix(checks, support, label: str, dtype: torch.dtype, shapes) -> None:
    """staged_case for every op and form of dtype; shapes: [(shape, small)]."""
    for op in ops_for(dtype):
        for shape, small in shapes:
            if dtype not in FLOATING:
                kinds = (True,)
            else:  # large ones: only the inexact inputs, where the CPU path matters most
                kinds = (True, False) if small else (False,)
            for form in FORMS:
                for integral in kinds:
                    checks.run(f"{label} {dtype_name(dtype)} {op} {shape} {form} "
                               f"integral={integral}",
                               staged_case, checks, support, dtype, op, shape, form, integral)


def big_shape(dtype: torch.dtype) -> tuple:
    """Just over 4 MiB, 2-d: pipelined in more chunks than ring slots, the last one ragged."""
    return (3, (4 << 20) // dtype.itemsize // 3 + 7)


@BOTH_PATHS
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_matrix(checks, gpu_path, dtype):
    """Every op x shape x form of dtype: bit for bit what fastreduce's CPU path gives for the
    same input, and equal to an independent torch reference where that is exact; copies per
    call; out-of-place calls leave x alone (a direct call: no copy)."""
    nbytes = math.prod(big_shape(dtype)) * dtype.itemsize
    chunk, nchunks = frcuda.plan_staging(nbytes)
    checks.check(nchunks > STAGING_SLOTS and nbytes % chunk != 0,
                 f"{dtype}: {nbytes} bytes are planned as {nchunks} chunks of {chunk}: "
                 f"the big case no longer exercises the pipeline's ring")
    run_matrix(checks, gpu_path, "matrix", dtype,
               [(s, True) for s in SMALL_SHAPES] + [(big_shape(dtype), False)])


@STAGED
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_chunked(checks, gpu_path, dtype):
    """The same for a 1 MiB tensor cut into 64 KiB chunks (set_staging_chunk)."""
    old = frcuda.set_staging_chunk(64 << 10)
    try:
        shape = ((1 << 20) // dtype.itemsize + 5,)
        plan = frcuda.plan_staging(shape[0] * dtype.itemsize)
        checks.check(plan == (64 << 10, 17), f"{dtype}: 64 KiB chunks planned as {plan}")
        run_matrix(checks, gpu_path, "chunked", dtype, [(shape, False)])
    finally:
        frcuda.set_staging_chunk(old)


# --- b, c. stream ordering ---------------------------------------------------------------

def positive_input(count: int, r: int, case) -> torch.Tensor:
    """float32 integers in 1..8: the sum over 2+ ranks exceeds every rank's own value."""
    g = torch.Generator(device=DEV)
    g.manual_seed(seed_of(case, r))
    return torch.randint(1, 9, (count,), generator=g, device=DEV).float()


def sleep_cycles(ms: float = 100.0) -> int:
    """Cycles of torch.cuda._sleep that keep this GPU busy for about `ms` (measured)."""
    probe = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    cycles = probe * ms / max(start.elapsed_time(end), 1e-3)
    return int(min(max(cycles, 20_000_000), 4_000_000_000))


def reduced_behind_sleep(checks, form: str, count: int, cycles: int, skip_waits: bool) -> bool:
    """Write x on a side stream behind a long kernel, reduce at once; is the sum right?"""
    case = ("ordering", form, count)
    src = positive_input(count, rank, case)
    want = sum(positive_input(count, r, case) for r in range(p))
    x = torch.zeros(count, device=DEV)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    WORLD.Barrier()  # every rank's kernel is still running when the others reduce
    frcuda._set_skip_waits(skip_waits)
    try:
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles)
            x.copy_(src)
            result = call(checks, form, x)
    finally:
        frcuda._set_skip_waits(False)
    s.synchronize()
    torch.cuda.synchronize()  # fastreduce's own streams too, before anything is reused
    return torch.equal(result, want)


@BOTH_PATHS
def test_ordering(checks, gpu_path):
    """Input written on a side stream behind a ~100 ms kernel is what gets reduced, and with
    fastreduce's host waits skipped (_set_skip_waits) it is not."""
    cycles = sleep_cycles()
    pipelined = (8 << 20) // 4
    checks.check(frcuda.plan_staging(4 * pipelined)[1] > 1, "8 MiB is not pipelined")
    cases = [(form, 1001) for form in FORMS] + [("in_place", pipelined), ("new", pipelined)]
    for form, count in cases:
        checks.check(reduced_behind_sleep(checks, form, count, cycles, False),
                     f"ordering: {form} of {count} float32 written behind a sleeping kernel on "
                     f"the current stream reduced stale data")
        if p > 1:  # with one rank a stale copy is as good as the sum
            checks.check(not reduced_behind_sleep(checks, form, count, cycles, True),
                         f"ordering: {form} of {count} float32 was right even with "
                         f"fastreduce's host waits skipped: this check cannot fail")


@BOTH_PATHS
def test_visible(checks, gpu_path):
    """A kernel queued on that stream right after the call sees the result."""
    pipelined = (32 << 20) // 4
    cases = [("in_place", 1001), ("new", 1001), ("iallreduce_", 1001), ("test", 1001),
             ("in_place", pipelined), ("new", pipelined), ("out", pipelined),
             ("iallreduce_", pipelined), ("test", pipelined)]
    for form, count in cases:
        case = ("visible", form, count)
        src = positive_input(count, rank, case)
        want = sum(positive_input(count, r, case) for r in range(p))
        s = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            x = src * 1  # produced on s
            if form == "test":
                req = fastreduce.iallreduce_(x)
                while not req.test():
                    pass
                result = x
            else:
                result = call(checks, form, x)
            y = result * 1  # queued on s the moment fastreduce returned
        s.synchronize()
        check_same(checks, torch.equal(y, want), f"visible: a kernel on the stream right after "
                   f"{form} of {count} float32 saw another result", y, want)


# --- d. copy counts ----------------------------------------------------------------------

@STAGED
def test_counts(checks, gpu_path):
    """1 copy each way per call (nchunks pipelined), one host wait per chunk, no pinned
    allocation in steady state."""
    forms = [("allreduce_", lambda t: fastreduce.allreduce_(t, "max"), True),
             ("allreduce", lambda t: fastreduce.allreduce(t, "max"), True),
             ("iallreduce_", lambda t: fastreduce.iallreduce_(t, "max").wait(), False)]
    for count in (1001, (4 << 20) // 4 + 1024):
        x = positive_input(count, rank, ("counts", count))
        nbytes = 4 * count
        for label, fn, blocking in forms:
            what = f"counts: {label} of {nbytes} bytes"
            chunks = expected_chunks(nbytes, blocking)
            if count == 1001:
                checks.check(chunks == 1, f"{what} is planned as {chunks} chunks")
            elif blocking:
                checks.check(chunks > 1, f"{what} is not pipelined")
            for _ in range(3):  # warm-up: the staging memory for this size
                fn(x)
            torch.cuda.synchronize()
            fastreduce.gpupaths.reset_gpu_copy_counts()
            fn(x)
            counts = fastreduce.gpupaths.gpu_copy_counts()
            check_counts(checks, counts, nbytes, chunks, what, chunks)
            pinned = counts["pinned_bytes"]
            fastreduce.gpupaths.reset_gpu_copy_counts()
            for _ in range(50):
                fn(x)
            torch.cuda.synchronize()
            counts = fastreduce.gpupaths.gpu_copy_counts()
            checks.check(counts["pinned_allocs"] == 0 and counts["pinned_bytes"] == pinned,
                         f"{what}: 50 calls after warm-up allocated pinned memory: {counts}")
            checks.check(counts["d2h_copies"] == counts["h2d_copies"] == 50 * chunks
                         and counts["d2h_bytes"] == counts["h2d_bytes"] == 50 * nbytes
                         and host_waits(counts) == 50 * chunks,
                         f"{what}: 50 calls made {counts}")


# --- e. coalesced --------------------------------------------------------------------------

COALESCED = ((torch.float32, (7,)), (torch.int32, (3, 4)), (torch.float32, (0,)),
             (torch.float64, (1001,)), (torch.bfloat16, (5,)), (torch.int64, (2, 3, 4)),
             (torch.float16, (300,)), (torch.uint8, (9,)), (torch.complex64, (6,)),
             (torch.float32, (4, 5)), (torch.int32, ()))


def coalesced_case(checks, op: str, integral: bool) -> None:
    case = ("coalesced", op, integral)
    specs = [(d, s) for d, s in COALESCED if fastreduce.supports(dtype_name(d), op)]
    tensors = [make_input(d, op, s, rank, (case, i), integral) for i, (d, s) in enumerate(specs)]
    on_cpu = fastreduce.allreduce_coalesced_([t.cpu().clone() for t in tensors], op)
    fastreduce.gpupaths.reset_gpu_copy_counts()
    result = fastreduce.allreduce_coalesced_(tensors, op)
    counts = fastreduce.gpupaths.gpu_copy_counts()
    checks.check(len(result) == len(tensors) and all(a is b for a, b in zip(result, tensors,
                                                                           strict=True)),
                 f"{case}: did not return the tensors")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    # a copy each way per tensor; one host wait per dtype (one MPI call per dtype)
    check_counts(checks, counts, nbytes, sum(t.numel() > 0 for t in tensors), case,
                 len({d for d, _ in specs}))
    for i, ((dtype, shape), t, c) in enumerate(zip(specs, tensors, on_cpu, strict=True)):
        what = f"{case} tensors[{i}] {dtype} {shape}"
        checks.check(t.device == DEV, f"{what}: moved to {t.device}")
        check_same(checks, same_bits(t, c), f"{what}: differs from the CPU path", t, c)
        if exact(dtype, op, integral):
            ref = reference([make_input(dtype, op, shape, r, (case, i), integral)
                             for r in range(p)], op)
            check_same(checks, torch.equal(t, ref), f"{what}: differs from the reference", t, ref)


@STAGED
def test_coalesced(checks, gpu_path):
    """allreduce_coalesced_ over mixed dtypes and shapes against the CPU path; a list mixing
    CPU and CUDA tensors is refused untouched."""
    for op in ("sum", "max", "avg", "prod"):
        for integral in (True, False):
            checks.run(f"coalesced {op} integral={integral}", coalesced_case, checks, op,
                       integral)
    device = f"cuda:{DEV.index}"
    g = torch.arange(4.0, device=DEV) + rank
    c = torch.arange(4.0) + rank
    checks.expect(ValueError, ["cpu", device],
                  lambda: fastreduce.allreduce_coalesced_([g, c]), Host(g), c)
    checks.expect(ValueError, ["cpu", device],
                  lambda: fastreduce.allreduce_coalesced_([c, g], "max"), c, Host(g))
    checks.check(torch.equal(g.cpu(), torch.arange(4.0) + rank), "refused coalesced call")


# --- f. bad input ------------------------------------------------------------------------

@STAGED
def test_bad_input(checks, gpu_path):
    """out= on the other device, another device's tensor, non-contiguous tensors."""
    device = f"cuda:{DEV.index}"
    x = torch.arange(6.0, device=DEV) + rank
    host_out = torch.zeros(6)
    checks.expect(ValueError, ["out", "cpu", device],
                  lambda: fastreduce.allreduce(x, out=host_out), Host(x), host_out)
    checks.expect(ValueError, ["out", "cpu", device],
                  lambda: fastreduce.iallreduce(x, out=host_out), Host(x), host_out)
    xc = torch.arange(6.0) + rank
    dev_out = torch.zeros(6, device=DEV)
    checks.expect(ValueError, ["out", "cpu", device],
                  lambda: fastreduce.allreduce(xc, out=dev_out), xc, Host(dev_out))
    checks.expect(ValueError, ["out", "cpu", device],
                  lambda: fastreduce.iallreduce(xc, out=dev_out), xc, Host(dev_out))
    strided = torch.zeros(4, 6, device=DEV).T
    checks.expect(BufferError, [".contiguous()"], lambda: fastreduce.allreduce_(strided),
                  Host(strided))
    checks.expect(BufferError, [".contiguous()"], lambda: fastreduce.iallreduce(strided),
                  Host(strided))
    checks.check(torch.equal(fastreduce.allreduce(x, "max"), torch.arange(6.0, device=DEV)
                             + (p - 1)), "a good call after the refused ones")
    ndev = torch.cuda.device_count()
    if ndev < 2:
        if rank == 0:
            print("bad_input: one GPU, so no tensor on a non-current device to refuse",
                  flush=True)
        return
    other = (DEV.index + 1) % ndev
    y = torch.arange(3.0, device=f"cuda:{other}")
    for fn in (fastreduce.allreduce_, fastreduce.allreduce, fastreduce.iallreduce_):
        checks.expect(ValueError, ["current CUDA device", f"cuda:{other}"],
                      lambda fn=fn: fn(y), Host(y))
    checks.expect(ValueError, ["current CUDA device"],
                  lambda: fastreduce.allreduce(x, out=torch.empty(6, device=f"cuda:{other}")),
                  Host(x))
    checks.expect(ValueError, ["current CUDA device"],
                  lambda: fastreduce.allreduce_coalesced_([torch.zeros(2, device=DEV), y]),
                  Host(y))


# --- g. layers -----------------------------------------------------------------------------

def same_values(a: torch.Tensor, b: torch.Tensor, integral: bool) -> bool:
    """a (on the GPU) equals b (CPU): exactly for integral inputs, else to rounding."""
    a = a.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if integral:
        return torch.equal(a, b)
    rtol = 1e-12 if a.dtype == torch.float64 else 1e-5
    return torch.allclose(a, b, rtol=rtol, atol=rtol)


def layer_case(checks, label: str, fn, dtype: torch.dtype, integral: bool) -> None:
    """fn forward + backward on CUDA equals fn on the same values on the CPU."""
    case = ("layer", label, dtype_name(dtype), integral)
    x = make_input(dtype, "sum", (4, 33), rank, case, integral).requires_grad_()
    grad = make_input(dtype, "sum", (4, 33), rank, (case, "grad"), integral)
    xc = x.detach().cpu().requires_grad_()
    y = fn(x)
    y.backward(grad)
    yc = fn(xc)
    yc.backward(grad.cpu())
    what = f"{label} {dtype_name(dtype)} integral={integral}"
    checks.check(y.device == DEV and x.grad is not None and x.grad.device == DEV,
                 f"{what}: result on {y.device}, gradient {x.grad}")
    check_same(checks, same_values(y, yc, integral), f"{what}: forward differs from the CPU",
               y.detach().cpu(), yc.detach())
    if x.grad is not None:
        check_same(checks, same_values(x.grad, xc.grad, integral),
                   f"{what}: backward differs from the CPU", x.grad.cpu(), xc.grad)
    with torch.no_grad():  # the steady state without autograd
        z, zc = fn(x), fn(xc)
    checks.check(p == 1 or not z.requires_grad, f"{what}: no-grad forward recorded a graph")
    check_same(checks, same_values(z, zc, integral),
               f"{what}: no-grad forward differs from the CPU", z.detach().cpu(), zc.detach())


@BOTH_PATHS
def test_layers(checks, gpu_path):
    """all_sum_reduce, nn.AllSumReduce, all_reduce: forward + backward vs CPU."""
    shape = [2, p // 2] if p % 2 == 0 else [p, 1]
    P = fastreduce.Partition().create_cartesian_topology_partition(shape)
    layers = {f"all_sum_reduce{axes} on {shape}":
              (lambda t, axes=axes: fastreduce.all_sum_reduce(t, P, axes))
              for axes in ([0], [1], [0, 1])}
    layers[f"nn.AllSumReduce(axes_reduce=[1]) on {shape}"] = AllSumReduce(P, axes_reduce=[1])
    layers[f"nn.AllSumReduce(axes_keep=[1]) on {shape}"] = AllSumReduce(P, axes_keep=[1])
    layers["all_reduce(sum, backward=identity)"] = fastreduce.all_reduce
    layers["all_reduce(avg, backward=sum)"] = (
        lambda t: fastreduce.all_reduce(t, op="avg", backward="sum"))
    for label, fn in layers.items():
        for dtype in (torch.float32, torch.float64):
            for integral in (True, False):
                checks.run(f"{label} {dtype} integral={integral}", layer_case, checks, label,
                           fn, dtype, integral)


def gradsync_case(checks, dtype: torch.dtype, bucket_mb: float, steps: int = 4) -> None:
    """A CUDA model under GradientSync and its CPU twin reduced tensor by tensor agree."""
    torch.manual_seed(1234)  # the same weights on every rank (the broadcast is tested alone)
    model = MLP(dtype).to(DEV)
    reference_model = MLP(dtype)
    reference_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    sync = fastreduce.GradientSync(model, bucket_mb=bucket_mb, broadcast_parameters=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1, momentum=0.9)
    sync.attach(opt)
    if bucket_mb < 1:
        checks.check(len(sync.bucket_sizes) > 3, f"buckets {sync.bucket_sizes}")
    g = torch.Generator().manual_seed(99 + rank)
    # GPU and CPU kernels round differently (and the step feeds that back), so the
    # comparison is to float tolerance; TF32 matmuls, if enabled, stay within it too
    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (2e-3, 1e-5)
    for step in range(steps):
        x = torch.randn(8, 6, generator=g, dtype=dtype)
        use = (step + rank) % 2 == 0
        opt.zero_grad()
        ref_opt.zero_grad()
        model(x.to(DEV), use).square().mean().backward()
        reference_model(x, use).square().mean().backward()
        sync.wait()
        for prm in reference_model.parameters():  # the one-by-one reference on the CPU
            if prm.grad is None:
                prm.grad = torch.zeros_like(prm)
            fastreduce.allreduce_(prm.grad, "avg")
        for (name, a), b in zip(model.named_parameters(), reference_model.parameters(),
                                strict=True):
            ok = (a.grad is not None and a.grad.device == DEV
                  and torch.allclose(a.grad.cpu(), b.grad, rtol=rtol, atol=atol))
            checks.check(ok, f"gradsync {dtype} bucket {bucket_mb} step {step}: grad of {name} "
                             f"differs by {(a.grad.cpu() - b.grad).abs().max().item():.3g}"
                         if a.grad is not None else f"gradsync: {name} has no grad")
        opt.step()
        ref_opt.step()
    flat = torch.cat([q.detach().reshape(-1).double().cpu() for q in model.parameters()])
    everyone = WORLD.allgather(flat.numpy())
    checks.check(all(np.array_equal(e, everyone[0]) for e in everyone),
                 f"gradsync {dtype} bucket {bucket_mb}: parameters differ across ranks")


@BOTH_PATHS
@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["one-bucket", "tiny-buckets"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_name)
def test_gradient_sync(checks, gpu_path, dtype, bucket_mb):
    """GradientSync on a CUDA MLP against a CPU reference run: one bucket, and many tiny
    ones in flight together."""
    gradsync_case(checks, dtype, bucket_mb)


# --- g. the data-movement collectives ------------------------------------------------------

MOVEMENT = ("broadcast_", "reduce_", "allgather", "allgather counts", "reduce_scatter",
            "reduce_scatter counts", "alltoall", "alltoall counts", "gather", "scatter",
            "send/recv")
SENTINEL = -7.0  # what an output holds before the call


def uneven(k: int) -> list[int]:
    """Elements per rank of the uneven calls, some 0 (from 3 ranks)."""
    return [k * ((r + 1) % 3) // 2 for r in range(p)]


def pair(i: int, j: int, k: int) -> int:
    """Elements rank i sends rank j in the uneven all-to-all (some 0)."""
    return k * ((i + 2 * j) % 3) // 2


def move(name: str, x: torch.Tensor, k: int, nonblocking: bool) -> torch.Tensor:
    """Collective `name` on this rank's x (CPU or CUDA; parts of k elements), blocking or
    started and waited for; returns what it wrote (a rank that receives nothing: empty)."""
    def out(n: int) -> torch.Tensor:
        return torch.full((n,), SENTINEL, device=x.device)

    def run(call, *args, **kw):
        request = getattr(fastreduce, "i" + call)(*args, **kw) if nonblocking else None
        return request.wait() if request is not None else getattr(fastreduce, call)(*args,
                                                                                     **kw)

    if name == "broadcast_":
        y = x[:k].clone()
        run("broadcast_", y, p - 1)
        return y
    if name == "reduce_":
        y = x[:k].clone()
        run("reduce_", y, "sum", 0)
        return y
    if name == "allgather":
        y = out(p * k)
        run("allgather", x[:k], out=y)
        return y
    if name == "allgather counts":
        counts = uneven(k)
        y = out(sum(counts))
        run("allgather", x[:counts[rank]], out=y, counts=counts)
        return y
    if name == "reduce_scatter":
        y = out(k)
        run("reduce_scatter", x[:p * k], "sum", out=y)
        return y
    if name == "reduce_scatter counts":
        counts = uneven(k)
        y = out(counts[rank])
        run("reduce_scatter", x[:sum(counts)], "sum", out=y, counts=counts)
        return y
    if name == "alltoall":
        y = out(p * k)
        run("alltoall", x[:p * k], out=y)
        return y
    if name == "alltoall counts":
        send = [pair(rank, j, k) for j in range(p)]
        recv = [pair(j, rank, k) for j in range(p)]
        y = out(sum(recv))
        run("alltoall", x[:sum(send)], out=y, send_counts=send, recv_counts=recv)
        return y
    if name == "gather":
        y = out(p * k) if rank == 0 else out(0)
        run("gather", x[:k], 0, out=y if rank == 0 else None)
        return y
    if name == "scatter":
        y = out(k)
        run("scatter", x[:p * k] if rank == 0 else None, 0, out=y)
        return y
    # send/recv: a ring, the odd ranks receiving first
    y, dest, source = out(k), (rank + 1) % p, (rank - 1) % p
    if nonblocking:
        received = fastreduce.irecv(y, source, 30 + source)
        fastreduce.isend(x[:k], dest, 30 + rank).wait()
        received.wait()
        return y
    if rank % 2:
        fastreduce.recv(y, source, 30 + source)
    fastreduce.send(x[:k], dest, 30 + rank)
    if rank % 2 == 0:
        fastreduce.recv(y, source, 30 + source)
    return y


def movement_input(k: int, case) -> torch.Tensor:
    """This rank's float32 input on the CPU: 3p parts of k small integers (exact sums)."""
    g = torch.Generator()
    g.manual_seed(seed_of(case, rank))
    return torch.randint(-50, 50, (3 * p * k,), generator=g).float()


def check_movement(checks, what: str, k: int, nonblocking: bool) -> None:
    """Every movement collective on CUDA memory: bit for bit what fastreduce's CPU path
    gives for the same inputs (tests/mpi/test_movement.py checks that path against numpy),
    the output's sentinel overwritten where the call writes, x left alone."""
    for name in MOVEMENT:
        case = f"{what}: {name}{' (started, waited for)' if nonblocking else ''} of {k}"
        x = movement_input(k, case)
        xd = x.to(DEV)
        want = move(name, x, k, nonblocking)
        got = move(name, xd, k, nonblocking)
        torch.cuda.synchronize()
        check_same(checks, got.device == DEV and torch.equal(got.cpu(), want), case,
                   got, want)
        check_same(checks, torch.equal(xd.cpu(), x), f"{case}: x changed", xd, x)


@BOTH_PATHS
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "started"])
def test_movement(checks, gpu_path, nonblocking):
    """broadcast_, reduce_, allgather, reduce_scatter, alltoall (equal and uneven), gather,
    scatter and send/recv on CUDA tensors against the CPU path: small, and pipelined in
    64 KiB chunks (parts of 256 KiB + 20 bytes)."""
    check_movement(checks, "movement", 1001, nonblocking)
    old = frcuda.set_staging_chunk(64 << 10)
    try:
        check_movement(checks, "movement chunked", (256 << 10) // 4 + 5, nonblocking)
    finally:
        frcuda.set_staging_chunk(old)


@BOTH_PATHS
def test_movement_ordering(checks, gpu_path):
    """x written on a side stream behind a ~100 ms kernel is what moves; a kernel queued on
    that stream right after the call sees what arrived."""
    cycles = sleep_cycles()
    # parts of 1 MiB: staged whole or pipelined as plan_staging says for each call; of
    # 9 MiB: pipelined, every call of equal blocks
    for name, k in [(name, k) for k in ((1 << 20) // 4 + 3, (9 << 20) // 4 + 3)
                    for name in MOVEMENT]:
        case = f"movement ordering: {name} of {k}"
        x = movement_input(k, case)
        want = move(name, x, k, False)
        xd = torch.zeros_like(x, device=DEV)
        s = torch.cuda.Stream()
        torch.cuda.synchronize()
        WORLD.Barrier()
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles)
            xd.copy_(x.pin_memory(), non_blocking=True)
            got = move(name, xd, k, False) * 1  # queued on s the moment the call returned
        s.synchronize()
        torch.cuda.synchronize()
        check_same(checks, torch.equal(got.cpu(), want), case, got, want)


@pytest.mark.mpi(ranks=2)
@STAGED
def test_gradient_sync_broadcasts_cuda_parameters(checks, gpu_path):
    """GradientSync(model) on a CUDA model (broadcast_parameters=True, the default) copies
    rank 0's parameters to every rank with an MPI that cannot read GPU memory. Last in this
    file: handing a device pointer to such an MPI crashes the process (the old test ran it
    in a job of its own)."""
    torch.manual_seed(4321 + rank)  # different weights on every rank
    model = MLP(torch.float32).to(DEV)
    root = WORLD.bcast([q.detach().cpu() for q in model.parameters()], root=0)
    fastreduce.GradientSync(model)
    for (name, q), want in zip(model.named_parameters(), root, strict=True):
        checks.check(q.device == DEV and torch.equal(q.detach().cpu(), want),
                     f"gradsync broadcast: {name} is not rank 0's")


