"""Which GPU path each call takes, over the fake CUDA runtime and a fake MPI layer.

The pointer log (tests/fakempi) records the kind of memory every MPI_Allreduce and
MPI_Iallreduce is handed, so these checks see what MPI itself was given:

  families     for each MPI family's answer (fake MPI_Get_library_version texts, CUDA-aware),
               every form, op and dtype in "direct" mode: device pointers reach exactly the
               calls that family promises to take them, and results equal the host path's
  modes        "staged" hands MPI no device pointer; pinned size tables split by size
  calibration  fake timings (slowest rank wins) give the same table on every rank, and the
               calls follow it; one calibration per communicator group; none when pinned
  failures     a calibration failing on one rank raises the same CalibrationError everywhere
  capture      a call on a stream capturing a CUDA graph raises before queueing anything

Needs FASTREDUCE_CUDART pointing at the fake runtime. The real MPI under it need not be
CUDA-aware: fake device memory is host memory.
"""

from __future__ import annotations

import math
import os

import fakempi

fakempi.install()  # before fastreduce, so that its MPI calls go through the log

import fakecuda  # noqa: E402
import numpy as np  # noqa: E402
from common import WORLD, Failures  # noqa: E402
from fake_dlpack import FakeTensor  # noqa: E402
from fakecuda import FakeCudaArray, FakeCudaTensor, Stream  # noqa: E402

import fastreduce  # noqa: E402
from fastreduce import calibration as calib  # noqa: E402
from fastreduce import gpupath, runtime  # noqa: E402
from fastreduce.backend import cudart as _cuda  # noqa: E402

fails = Failures()
check, expect = fails.check, fails.expect
rank, size = WORLD.rank, WORLD.size
BF16 = (4, 16, 1)

FAMILIES = {  # name -> (MPI_Get_library_version text, environment, blocking, non-blocking, 16-bit)
    "Open MPI 4.1": ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4", {},
                     True, False, True),
    "Open MPI 5.0": ("Open MPI v5.0.11, package: Open MPI, ident: 5.0.11", {}, True, False, True),
    "MPICH 4.2": ("MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024", {},
                  True, True, False),
    "MPICH 3.4": ("MPICH Version:      3.4.3\nMPICH Release date: Thu Dec 16 2021", {},
                  True, False, False),
    "Cray MPICH, GPU on": ("MPI VERSION    : CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)",
                           {"MPICH_GPU_SUPPORT_ENABLED": "1"}, True, True, False),
    "Cray MPICH, GPU off": ("MPI VERSION    : CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)",
                            {}, False, False, False),
    "MVAPICH2-GDR": ("MVAPICH2-GDR Version 2.3.7\nMVAPICH2 Release date: 2022", {},
                     True, True, False),
    "Intel MPI": ("Intel(R) MPI Library 2021.11 for Linux* OS", {"I_MPI_OFFLOAD": "1"},
                  True, False, False),
    "unknown": ("SomeVendor MPI 1.0", {}, True, False, False),
}


def values_of(n: int, r: int, dtype) -> np.ndarray:
    """Small integers (exact sums in every dtype), different on every rank."""
    return ((np.arange(n) * 7 + r * 3) % 5 + 1).astype(dtype)


def host_result(values: np.ndarray, op: str, dl=None) -> np.ndarray:
    a = values.copy()
    fastreduce.allreduce_(FakeTensor(a, dtype=dl) if dl else a, op)
    return a


def logged(fn):
    """(what fn returned, pointer-log counts, fastreduce's path counts) of fn()."""
    fakecuda.quiesce()
    fakempi.reset()
    _cuda.reset_copy_counts()
    out = fn()
    fakecuda.quiesce()
    return out, fakempi.counts(), _cuda.copy_counts()


def use_family(name: str | None) -> None:
    """Make fastreduce see the family's MPI (None: the real one again)."""
    for variable in ("MPICH_GPU_SUPPORT_ENABLED", "I_MPI_OFFLOAD"):
        os.environ.pop(variable, None)
    if name is None:
        gpupath._library_version = real_library_version
        runtime.set_cuda_aware(None)
        return
    text, environ, *_ = FAMILIES[name]
    os.environ.update(environ)
    gpupath._library_version = lambda: text
    runtime.set_cuda_aware(True)


real_library_version = gpupath._library_version
REAL_MEASURE = calib._measure
for variable in ("FASTREDUCE_GPU_PATH", "FASTREDUCE_GPU_THRESHOLDS",
                 "FASTREDUCE_GPU_THRESHOLDS_FILE", "FASTREDUCE_DEVICE_POINTERS"):
    os.environ.pop(variable, None)


# --- families: device pointers reach only the calls each MPI promises ----------------------
def forms(g, op):
    """(form, blocking, fn) for every way of reducing g."""
    return [
        ("allreduce_", True, lambda: fastreduce.allreduce_(g, op)),
        ("allreduce", True, lambda: fastreduce.allreduce(g, op)),
        ("out=", True, lambda: fastreduce.allreduce(g, op, out=fakecuda.empty_like(g))),
        ("iallreduce_", False, lambda: fastreduce.iallreduce_(g, op).wait()),
        ("iallreduce", False, lambda: fastreduce.iallreduce(g, op).wait()),
        ("wait_all", False, lambda: fastreduce.wait_all(
            [fastreduce.iallreduce(g, op), fastreduce.iallreduce_(copy_of(g), op)])[0]),
        ("coalesced", True, lambda: fastreduce.allreduce_coalesced_([g, copy_of(g)], op)[0]),
    ]


def copy_of(g: FakeCudaArray) -> FakeCudaArray:
    return FakeCudaArray.from_numpy(g.to_numpy(), dlpack_dtype=g.dlpack_dtype)


runtime.set_gpu_path("direct")
for family, (_, _, blocking_ok, nonblocking_ok, half_ok) in FAMILIES.items():
    use_family(family)
    support = gpupath.device_pointer_support()
    check((support.blocking, support.nonblocking, support.half)
          == (blocking_ok, nonblocking_ok, half_ok), f"{family}: table says {support}")
    for dtype, dl, half in (("float32", None, False), ("float16", None, True),
                            ("uint16", BF16, True), ("int64", None, False)):
        for op in ("sum", "max", "avg"):
            name = "bfloat16" if dl else dtype
            if not fastreduce.supports(name, op):
                continue
            values = values_of(1001, rank, dtype)
            want = host_result(values, op, dl)
            # MPI's own op and datatype, not fastreduce's host-side work (avg, 16-bit ops)
            mpi_own = op != "avg" and not (
                half and f"{op}: fastreduce op" in fastreduce.half_precision_paths()[name])
            for index in range(7):
                g = FakeCudaArray.from_numpy(values, dlpack_dtype=dl)
                form, blocking, fn = forms(g, op)[index]
                result, log, paths = logged(fn)
                promised = (blocking_ok if blocking else nonblocking_ok) and (half_ok or not half)
                direct = promised and mpi_own
                device = log["allreduce"]["device"] + log["iallreduce"]["device"]
                what = f"{family}: {form} {name} {op}"
                check(log["iallreduce"]["device"] == 0 or nonblocking_ok,
                      f"{what}: MPI_Iallreduce got device pointers it does not promise to "
                      f"take: {log}")
                check((device > 0) == direct, f"{what}: {device} calls with device pointers, "
                      f"expected {'some' if direct else 'none'}: {log}")
                check((paths["direct_calls"] > 0) == direct
                      and (paths["staged_calls"] > 0) == (not direct),
                      f"{what}: path counters {paths}")
                check(np.array_equal(result.to_numpy(), want), f"{what}: result")

# --- algorithms and compression: combined on the host, so CUDA memory goes staged -----------
# (an MPI promising blocking calls on device memory, direct mode: only these force staging)
use_family("MPICH 4.2")
for what, algorithm, wire in (("bf16 compression", "mpi", "bf16"),
                              ("fp16 compression, ring", "ring", "fp16"),
                              ("ring", "ring", None), ("hierarchical", "hierarchical", None),
                              ("rsag", "rsag", None)):
    fastreduce.algorithms.set_algorithm(algorithm)
    values = np.linspace(-1, 1, 3001, dtype=np.float32) * (rank + 1)
    want = values.copy()
    fastreduce.allreduce_(want, compression=wire)
    for form, call in (
            ("allreduce_", lambda g, w=wire: fastreduce.allreduce_(g, compression=w)),
            ("allreduce", lambda g, w=wire: fastreduce.allreduce(g, compression=w)),
            ("iallreduce_", lambda g, w=wire: fastreduce.iallreduce_(g, compression=w).wait())):
        g = FakeCudaArray.from_numpy(values)
        result, log, paths = logged(lambda g=g, call=call: call(g))
        check(log["allreduce"]["device"] + log["iallreduce"]["device"] == 0
              and paths["direct_calls"] == 0 and paths["staged_calls"] == 1,
              f"{what}: {form} on CUDA memory did not go staged: {log} {paths}")
        check(np.array_equal(result.to_numpy(), want),
              f"{what}: {form} on CUDA memory differs from the host's")
fastreduce.algorithms.set_algorithm(None)
use_family(None)

# --- modes: staged hands MPI no device pointer; pinned tables split by size ------------------
runtime.set_device_pointer_calls("blocking,nonblocking")
runtime.set_gpu_path("staged")
g = FakeCudaArray.from_numpy(values_of(1001, rank, np.float32))
_, log, paths = logged(lambda: (fastreduce.allreduce_(g), fastreduce.iallreduce_(g).wait()))
# (the non-blocking one reduces pinned memory too: in MPI_Allreduce calls of the progress
# engine, or in an MPI_Iallreduce without it)
check(log["allreduce"]["device"] + log["iallreduce"]["device"] == 0
      and log["allreduce"]["pinned"] + log["iallreduce"]["pinned"] == 2,
      f"staged mode: {log}")
check(paths["staged_calls"] == 2 and paths["direct_calls"] == 0, f"staged mode: {paths}")

runtime.set_gpu_path("auto")
for spec, source in (("0:direct,4KiB:staged,1MiB:direct", "set"),
                     ("0:direct,4KiB:staged,1MiB:direct", "FASTREDUCE_GPU_THRESHOLDS"),
                     ("# measured on our cluster\n0:direct,4KiB:staged,1MiB:direct\n",
                      "FASTREDUCE_GPU_THRESHOLDS_FILE")):
    measured = []
    calib._measure = lambda *args, measured=measured: measured.append(args)
    if source == "set":
        runtime.set_gpu_thresholds(spec)
    elif source == "FASTREDUCE_GPU_THRESHOLDS":
        runtime.set_gpu_thresholds(None)
        os.environ[source] = spec
    else:
        os.environ.pop("FASTREDUCE_GPU_THRESHOLDS")
        path = f"thresholds-{os.getpid()}.txt"
        with open(path, "w") as f:
            f.write(spec)
        os.environ[source] = path
    fastreduce.runtime.set_gpu_path("auto")  # read the environment again
    for nbytes, want_direct in ((4, True), (4092, True), (4096, False), (65536, False),
                                ((1 << 20) - 4, False), (1 << 20, True), (3 << 20, True)):
        for index in range(5):  # allreduce_, allreduce, out=, iallreduce_, iallreduce
            g = FakeCudaArray.from_numpy(values_of(nbytes // 4, rank, np.float32))
            label, _, fn = forms(g, "sum")[index]
            _, log, paths = logged(fn)
            device = log["allreduce"]["device"] + log["iallreduce"]["device"]
            check((device > 0) == want_direct and (paths["direct_calls"] > 0) == want_direct,
                  f"pinned table ({source}): {label} of {nbytes} bytes: {log} {paths}")
    check(not measured, f"pinned table ({source}): a calibration ran: {measured}")
os.remove(os.environ.pop("FASTREDUCE_GPU_THRESHOLDS_FILE"))

# --- calibration with fake timings -------------------------------------------------------------
real_measure = REAL_MEASURE
runtime.set_gpu_thresholds(None)
runtime.set_gpu_path("auto")


def fake_seconds(nbytes: int, path: str, r: int) -> float:
    """Direct: 10 us + 1 GB/s; staged: 30 us + 4 GB/s; rank 1's direct calls 2.5x slower."""
    t = 10e-6 + nbytes / 1e9 if path == "direct" else 30e-6 + nbytes / 4e9
    return t * 2.5 if (path == "direct" and r == 1) else t


calls = []


def faked(comm, ptr, nbytes, path, reps):
    """The real calls (so the ranks' MPI calls match as in a real calibration), fake times."""
    calls.append((comm.Get_size(), nbytes, path))
    real_measure(comm, ptr, nbytes, path, reps)
    return [fake_seconds(nbytes, path, comm.Get_rank())] * reps


def expected_table(ranks: range) -> list[tuple[int, str]]:
    """The table the fake timings call for, worked out here: per size the path whose slowest
    rank is faster; a switch half-way (geometrically) between two sizes."""
    sizes = calib.CALIBRATION_SIZES
    chosen = []
    for n in sizes:
        d = max(fake_seconds(n, "direct", r) for r in ranks)
        s = max(fake_seconds(n, "staged", r) for r in ranks)
        chosen.append("direct" if d < s else "staged")
    steps = [(0, chosen[0])]
    for i in range(1, len(sizes)):
        if chosen[i] != chosen[i - 1]:
            steps.append((int(math.sqrt(sizes[i - 1] * sizes[i])) // 4 * 4, chosen[i]))
    return steps


calib._measure = faked
want = expected_table(range(size))
check(len(want) == 2 and want[0] == (0, "direct"), f"the fake timings give a switch: {want}")
switch = want[1][0]
small = FakeCudaArray.from_numpy(values_of(switch // 4 - 1, rank, np.float32))
big = FakeCudaArray.from_numpy(values_of(switch // 4 + 1, rank, np.float32))
fastreduce.allreduce_(small)  # calibrates (collective)
check(len(calls) == 2 * len(calib.CALIBRATION_SIZES), f"one calibration: {len(calls)} timings")
_, log, paths = logged(lambda: fastreduce.allreduce_(small))
check(log["allreduce"]["device"] == 1 and paths["direct_calls"] == 1,
      f"below the switch ({switch} bytes): direct, got {log} {paths}")
_, log, paths = logged(lambda: fastreduce.allreduce_(big))
check(log["allreduce"]["device"] == 0 and paths["staged_calls"] == 1,
      f"above the switch: staged, got {log} {paths}")
tables = WORLD.allgather(gpupath._calibrated[-1][1])
check(all(list(t) == want for t in tables), f"every rank's table is {want}: {tables}")

# the same group again (a duplicate communicator): no second calibration
dup = fastreduce.default_comm().Dup()
calls.clear()
fastreduce.allreduce_(small, comm=dup)
check(not calls, f"a communicator of a calibrated group calibrated again: {calls}")
# another group calibrates once, over its own ranks
if size > 1:
    half = WORLD.Split(rank % 2, rank)
    fastreduce.allreduce_(small, comm=half)
    fastreduce.allreduce_(big, comm=half)
    check(len(calls) == 2 * len(calib.CALIBRATION_SIZES)
          and all(c[0] == half.Get_size() for c in calls),
          f"a new group: one calibration on its {half.Get_size()} ranks, got {len(calls)}")
    got = gpupath._calibrated[-1][1]  # fake_seconds slows the direct calls of half's rank 1
    check(list(got) == expected_table(range(half.Get_size())), f"half {rank % 2}: {got}")
    half.Free()
dup.Free()

# calibrate() and fastreduce-info's settings describe it
calibration = calib.calibrate(details=True)
check(list(calibration.table.steps) == want and len(calibration.direct) == len(
    calib.CALIBRATION_SIZES), f"calibrate(details=True): {calibration}")
check("calibrated" in gpupath.gpu_path_settings()["size table"],
      f"settings: {gpupath.gpu_path_settings()}")

# --- failures: one rank's error is every rank's CalibrationError -------------------------------
def failing(where: str, at: int, done: int):
    """The last rank fails timing `where` at `at` bytes, after `done` of its calls."""
    def measure(comm, ptr, nbytes, path, reps):
        if comm.Get_rank() == size - 1 and nbytes == at and path == where:
            real_measure(comm, ptr, nbytes, path, done)  # part of the MPI calls made
            raise RuntimeError("fastreduce: CUDA cudaMemcpyAsync failed: injected (error 1)")
        return faked(comm, ptr, nbytes, path, reps)
    return measure


# before any call; half-way through a pipelined staged measurement (2 MPI calls per rep)
# and half-way through direct 1 MiB calls cut into 64 KiB segments (16 MPI calls a rep)
for where, at, done, segment in (("direct", 4096, 0, None), ("staged", 1 << 20, 4, None),
                                 ("direct", 1 << 20, 3, 64 << 10)):
    old_segment = fastreduce.runtime.set_segment_bytes(
        segment if segment else fastreduce.runtime.segment_bytes())
    if where == "staged":
        check(calib._call_counts(at, "staged") == [at // 8] * 2,
              f"1 MiB staged is 2 MPI calls: {calib._call_counts(at, 'staged')}")
    if segment:
        check(calib._call_counts(at, where) == [segment // 4] * 16,
              f"1 MiB in 64 KiB segments: {calib._call_counts(at, where)}")
    calib._measure = failing(where, at, done)
    fresh = fastreduce.default_comm().Create_group(fastreduce.default_comm().Get_group().Incl(
        list(range(size))[::-1]))  # same members, another order: counts as calibrated
    gpupath._calibrated.clear()
    messages = []
    x = FakeCudaArray.from_numpy(values_of(10, rank, np.float32))
    before = x.to_numpy()
    try:
        fastreduce.allreduce_(x, comm=fresh)
    except fastreduce.CalibrationError as exc:
        messages.append(str(exc))
    except Exception as exc:  # noqa: BLE001
        messages.append(f"wrong exception {exc!r}")
    everyone = WORLD.allgather(messages[0] if messages else None)
    check(all(m is not None and m == everyone[0] for m in everyone),
          f"failure in {where}: every rank raises the same CalibrationError: {everyone}")
    check(everyone[0] is not None and f"failed on rank {size - 1}" in everyone[0]
          and "injected" in everyone[0] and "FASTREDUCE_GPU_PATH=staged" in everyone[0],
          f"the message names the rank, the error and the way out: {everyone[0]}")
    check(np.array_equal(x.to_numpy(), before), "a failed calibration leaves x alone")
    fresh.Free()
    fastreduce.runtime.set_segment_bytes(old_segment)
# an allocation failure on one rank
real_alloc = _cuda.device_alloc
if rank == 0:
    def no_memory(nbytes):
        raise RuntimeError("fastreduce: CUDA cudaMalloc failed: out of memory (error 2)")
    _cuda.device_alloc = no_memory
calib._measure = faked
try:
    calib.calibrate()
    outcome = "no error"
except fastreduce.CalibrationError as exc:
    outcome = str(exc)
_cuda.device_alloc = real_alloc
outcomes = WORLD.allgather(outcome)
check(all(o == outcomes[0] and "rank 0" in o and "cudaMalloc" in o for o in outcomes),
      f"allocation failure on rank 0: {outcomes}")

# bad settings: the variable and the fix are named, nothing runs
calib._measure = faked
runtime.set_device_pointer_calls(None)
for variable, value, words in (
        ("FASTREDUCE_GPU_PATH", "fast", ["FASTREDUCE_GPU_PATH='fast'", "auto, direct, staged"]),
        ("FASTREDUCE_GPU_THRESHOLDS", "64KiB:direct", ["start at 0"]),
        ("FASTREDUCE_GPU_THRESHOLDS", "0:fast", ["SIZE:PATH"]),
        ("FASTREDUCE_DEVICE_POINTERS", "all", ["'none'", "blocking, nonblocking, 16bit"]),
        ("FASTREDUCE_GPU_THRESHOLDS_FILE", "/nonexistent/table", ["cannot be read"])):
    os.environ[variable] = value
    runtime.set_gpu_path(None)
    x = FakeCudaArray.from_numpy(values_of(10, rank, np.float32))
    expect(ValueError, words, lambda x=x: fastreduce.allreduce_(x), x)
    del os.environ[variable]
# ranks that disagree, or one rank's bad setting: every rank raises, none hangs
if size > 1:
    for label, variable, value in (("disagree", "FASTREDUCE_GPU_PATH", "staged"),
                                   ("bad on rank 0", "FASTREDUCE_GPU_PATH", "fast")):
        if rank == 0:
            os.environ[variable] = value
        runtime.set_gpu_path(None)
        x = FakeCudaArray.from_numpy(values_of(10, rank, np.float32))
        if label == "disagree":
            words = ["disagree on the GPU path settings", "rank 0: mode staged",
                     "FASTREDUCE_GPU_PATH"]
        elif rank == 0:
            words = ["FASTREDUCE_GPU_PATH='fast'"]
        else:
            words = ["rank 0 of this communicator has a bad GPU path setting", "'fast'"]
        expect(ValueError, words, lambda x=x: fastreduce.allreduce_(x), x)
        os.environ.pop(variable, None)
runtime.set_gpu_path("auto")
runtime.set_device_pointer_calls("blocking,nonblocking")

# --- capture: nothing is queued on a stream that is capturing a CUDA graph ----------------------
runtime.set_gpu_path("staged")
stream = Stream()
fakecuda.set_current_stream(stream)
x = FakeCudaTensor.from_numpy(values_of(1001, rank, np.float32), stream=stream)
stream.synchronize()
for label, fn in (("allreduce_", lambda: fastreduce.allreduce_(x)),
                  ("allreduce", lambda: fastreduce.allreduce(x)),
                  ("iallreduce_", lambda: fastreduce.iallreduce_(x)),
                  ("coalesced", lambda: fastreduce.allreduce_coalesced_([x]))):
    for mode in ("staged", "direct"):
        runtime.set_gpu_path(mode)
        fakecuda.reset_counters()
        stream.begin_capture()
        expect(RuntimeError, ["captured into a CUDA graph", "outside the captured region"], fn, x)
        status = stream.capture_status()
        check(stream.end_capture() == 0 and status == fakecuda.CAPTURE_ACTIVE,
              f"{label} ({mode}): the capture was disturbed")
        check(fakecuda.counters()["capture_violations"] == 0, f"{label} ({mode}): queued work")
fakecuda.set_current_stream(None)
check(np.array_equal(fastreduce.allreduce_(x).to_numpy(),
                     host_result(values_of(1001, rank, np.float32), "sum")),
      "after the capture ends, the call works")

runtime.set_gpu_path(None)
runtime.set_device_pointer_calls(None)
fakecuda.quiesce()
fails.finish()
