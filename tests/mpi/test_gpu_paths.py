"""Which GPU path each call takes (direct or staged), what each MPI promises, the settings
and the calibration: over the fake CUDA runtime and a fake MPI layer that records the kind of
memory every all-reduce is handed (tests/support/fakempi).

The pointer log records the kind of memory every MPI_Allreduce and MPI_Iallreduce is handed,
so these checks see what MPI itself was given (profile fakecuda, which loads it
before fastreduce; on 1 to 4 ranks):

  families     for each MPI family's answer (fake MPI_Get_library_version texts, CUDA-aware),
               every form, op and dtype in "direct" mode: device pointers reach exactly the
               calls that family promises to take them, and results equal the host path's
  algorithms   host-side algorithms and compression take CUDA memory staged
  modes        "staged" hands MPI no device pointer; pinned size tables split by size
  calibration  fake timings (slowest rank wins) give the same table on every rank, and the
               calls follow it; one calibration per communicator group; none when pinned
  failures     a calibration failing on one rank raises the same CalibrationError everywhere;
               bad or disagreeing settings are refused on every rank
  capture      a call on a stream capturing a CUDA graph raises before queueing anything

The real MPI under the fakes need not be CUDA-aware: fake device memory is host memory.
The table of MPI promises, size tables and settings (fastreduce.gpupaths) need neither fake:
one rank, default profile.
"""

from __future__ import annotations

import contextlib
import math
import re

import fakecuda
import fakempi
import numpy as np
import pytest
from fake_dlpack import FakeTensor
from fakecuda import FakeCudaArray, FakeCudaTensor, Stream
from mpi4py import MPI

import fastreduce
from fastreduce import gpupaths
from fastreduce.backend import cudart as _cuda
from fastreduce.gpupaths import PathTable, capabilities, mpi_promises
from fastreduce.gpupaths import calibration as calib
from fastreduce.sizes import parse_size

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
BF16 = (4, 16, 1)
REAL_MEASURE = calib._measure

over_the_fakes = pytest.mark.mpi(profile="fakecuda")
one_rank = pytest.mark.mpi(ranks=1)

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
# dtype, DLPack dtype (bfloat16 as uint16 storage), 16-bit
DTYPES = {"float32": ("float32", None, False), "float16": ("float16", None, True),
          "bfloat16": ("uint16", BF16, True), "int64": ("int64", None, False)}


def slug(text: str) -> str:
    """A case id -k can name: "Cray MPICH, GPU on" -> "cray-mpich-gpu-on"."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


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
    gpupaths.reset_gpu_copy_counts()
    out = fn()
    fakecuda.quiesce()
    return out, fakempi.counts(), gpupaths.gpu_copy_counts()


def copy_of(g: FakeCudaArray) -> FakeCudaArray:
    return FakeCudaArray.from_numpy(g.to_numpy(), dlpack_dtype=g.dlpack_dtype)


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


def reset_gpu_settings() -> None:
    """Every run-time GPU path setting back to the environment's (and nothing calibrated)."""
    gpupaths.set_gpu_path(None)
    gpupaths.set_gpu_thresholds(None)
    gpupaths.set_device_pointer_calls(None)
    gpupaths.set_cuda_aware(None)
    fastreduce.algorithms.set_algorithm(None)
    calib._calibrated.clear()


@pytest.fixture
def gpu_settings(monkeypatch):
    """A case that changes the GPU path settings: none set before it, none left after it
    (the environment through monkeypatch)."""
    for variable in ("FASTREDUCE_GPU_PATH", "FASTREDUCE_GPU_THRESHOLDS",
                     "FASTREDUCE_GPU_THRESHOLDS_FILE", "FASTREDUCE_DEVICE_POINTERS",
                     "MPICH_GPU_SUPPORT_ENABLED", "I_MPI_OFFLOAD"):
        monkeypatch.delenv(variable, raising=False)
    reset_gpu_settings()
    yield monkeypatch
    reset_gpu_settings()
    fakecuda.quiesce()


def use_family(monkeypatch, name: str) -> None:
    """Make fastreduce see the family's MPI (until the case ends)."""
    text, environ, *_ = FAMILIES[name]
    for variable, value in environ.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setattr(capabilities, "_library_version", lambda: text)
    gpupaths.set_cuda_aware(True)


# --- families: device pointers reach only the calls each MPI promises ----------------------

@over_the_fakes
@pytest.mark.parametrize("family", FAMILIES, ids=slug)
def test_family_promises(checks, gpu_settings, family):
    """The table's promises for the family's MPI, CUDA-aware."""
    _, _, blocking_ok, nonblocking_ok, half_ok = FAMILIES[family]
    use_family(gpu_settings, family)
    support = gpupaths.device_pointer_support()
    checks.check((support.blocking, support.nonblocking, support.half)
                 == (blocking_ok, nonblocking_ok, half_ok), f"{family}: table says {support}")


@over_the_fakes
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("family", FAMILIES, ids=slug)
def test_family_device_pointers(checks, gpu_settings, family, name):
    """Direct mode, every form and op: device pointers reach exactly the calls the family
    promises to take them (MPI's own op and datatype), results equal the host path's."""
    _, _, blocking_ok, nonblocking_ok, half_ok = FAMILIES[family]
    dtype, dl, half = DTYPES[name]
    gpupaths.set_gpu_path("direct")
    use_family(gpu_settings, family)
    for op in ("sum", "max", "avg"):
        if not fastreduce.supports(name, op):
            continue
        values = values_of(1001, RANK, dtype)
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
            checks.check(log["iallreduce"]["device"] == 0 or nonblocking_ok,
                         f"{what}: MPI_Iallreduce got device pointers it does not promise to "
                         f"take: {log}")
            checks.check((device > 0) == direct, f"{what}: {device} calls with device "
                         f"pointers, expected {'some' if direct else 'none'}: {log}")
            checks.check((paths["direct_calls"] > 0) == direct
                         and (paths["staged_calls"] > 0) == (not direct),
                         f"{what}: path counters {paths}")
            checks.check(np.array_equal(result.to_numpy(), want), f"{what}: result")


# --- algorithms and compression: combined on the host, so CUDA memory goes staged -----------

@over_the_fakes
@pytest.mark.parametrize(("what", "algorithm", "wire"), [
    ("bf16 compression", "mpi", "bf16"), ("fp16 compression, ring", "ring", "fp16"),
    ("ring", "ring", None), ("hierarchical", "hierarchical", None), ("rsag", "rsag", None),
], ids=["bf16-compression", "fp16-compression-ring", "ring", "hierarchical", "rsag"])
def test_host_side_work_goes_staged(checks, gpu_settings, what, algorithm, wire):
    """An MPI promising blocking calls on device memory, direct mode: algorithms and
    compression that combine on the host still take CUDA memory staged."""
    gpupaths.set_gpu_path("direct")
    use_family(gpu_settings, "MPICH 4.2")
    fastreduce.algorithms.set_algorithm(algorithm)
    values = np.linspace(-1, 1, 3001, dtype=np.float32) * (RANK + 1)
    want = values.copy()
    fastreduce.allreduce_(want, compression=wire)
    for form, call in (
            ("allreduce_", lambda g: fastreduce.allreduce_(g, compression=wire)),
            ("allreduce", lambda g: fastreduce.allreduce(g, compression=wire)),
            ("iallreduce_", lambda g: fastreduce.iallreduce_(g, compression=wire).wait())):
        g = FakeCudaArray.from_numpy(values)
        result, log, paths = logged(lambda g=g, call=call: call(g))
        checks.check(log["allreduce"]["device"] + log["iallreduce"]["device"] == 0
                     and paths["direct_calls"] == 0 and paths["staged_calls"] == 1,
                     f"{what}: {form} on CUDA memory did not go staged: {log} {paths}")
        checks.check(np.array_equal(result.to_numpy(), want),
                     f"{what}: {form} on CUDA memory differs from the host's")


# --- modes: staged hands MPI no device pointer; pinned tables split by size ------------------

@over_the_fakes
def test_staged_mode(checks, gpu_settings):
    """"staged" hands MPI no device pointer, blocking or not, whatever the MPI promises."""
    gpupaths.set_device_pointer_calls("blocking,nonblocking")
    gpupaths.set_gpu_path("staged")
    g = FakeCudaArray.from_numpy(values_of(1001, RANK, np.float32))
    _, log, paths = logged(lambda: (fastreduce.allreduce_(g), fastreduce.iallreduce_(g).wait()))
    # (the non-blocking one reduces pinned memory too: in MPI_Allreduce calls of the progress
    # engine, or in an MPI_Iallreduce without it)
    checks.check(log["allreduce"]["device"] + log["iallreduce"]["device"] == 0
                 and log["allreduce"]["pinned"] + log["iallreduce"]["pinned"] == 2,
                 f"staged mode: {log}")
    checks.check(paths["staged_calls"] == 2 and paths["direct_calls"] == 0,
                 f"staged mode: {paths}")


@over_the_fakes
@pytest.mark.parametrize(("spec", "source"), [
    ("0:direct,4KiB:staged,1MiB:direct", "set"),
    ("0:direct,4KiB:staged,1MiB:direct", "FASTREDUCE_GPU_THRESHOLDS"),
    ("# measured on our cluster\n0:direct,4KiB:staged,1MiB:direct\n",
     "FASTREDUCE_GPU_THRESHOLDS_FILE"),
], ids=["set_gpu_thresholds", "FASTREDUCE_GPU_THRESHOLDS", "FASTREDUCE_GPU_THRESHOLDS_FILE"])
def test_pinned_size_table(checks, gpu_settings, tmp_path, spec, source):
    """A pinned size table splits the calls by size, and no calibration runs."""
    gpupaths.set_device_pointer_calls("blocking,nonblocking")
    gpupaths.set_gpu_path("auto")
    measured = []
    gpu_settings.setattr(calib, "_measure", lambda *args: measured.append(args))
    if source == "set":
        gpupaths.set_gpu_thresholds(spec)
    elif source == "FASTREDUCE_GPU_THRESHOLDS":
        gpu_settings.setenv(source, spec)
    else:
        path = tmp_path / "thresholds.txt"
        path.write_text(spec)
        gpu_settings.setenv(source, str(path))
    gpupaths.set_gpu_path("auto")  # read the environment again
    for nbytes, want_direct in ((4, True), (4092, True), (4096, False), (65536, False),
                                ((1 << 20) - 4, False), (1 << 20, True), (3 << 20, True)):
        for index in range(5):  # allreduce_, allreduce, out=, iallreduce_, iallreduce
            g = FakeCudaArray.from_numpy(values_of(nbytes // 4, RANK, np.float32))
            label, _, fn = forms(g, "sum")[index]
            _, log, paths = logged(fn)
            device = log["allreduce"]["device"] + log["iallreduce"]["device"]
            checks.check((device > 0) == want_direct
                         and (paths["direct_calls"] > 0) == want_direct,
                         f"pinned table ({source}): {label} of {nbytes} bytes: {log} {paths}")
    checks.check(not measured, f"pinned table ({source}): a calibration ran: {measured}")


# --- calibration with fake timings -------------------------------------------------------------

def fake_seconds(nbytes: int, path: str, r: int) -> float:
    """Direct: 10 us + 1 GB/s; staged: 30 us + 4 GB/s; rank 1's direct calls 2.5x slower."""
    t = 10e-6 + nbytes / 1e9 if path == "direct" else 30e-6 + nbytes / 4e9
    return t * 2.5 if (path == "direct" and r == 1) else t


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


class FakeTimings:
    """calibration._measure's replacement: the real calls (so the ranks' MPI calls match as
    in a real calibration), fake times; `calls` lists (ranks, bytes, path) of each."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, str]] = []

    def __call__(self, comm, ptr, nbytes, path, reps):
        self.calls.append((comm.Get_size(), nbytes, path))
        REAL_MEASURE(comm, ptr, nbytes, path, reps)
        return [fake_seconds(nbytes, path, comm.Get_rank())] * reps


@pytest.fixture
def fake_timings(gpu_settings) -> FakeTimings:
    """Auto mode, an MPI promising device pointers, nothing calibrated, fake timings."""
    timings = FakeTimings()
    gpu_settings.setattr(calib, "_measure", timings)
    gpupaths.set_device_pointer_calls("blocking,nonblocking")
    gpupaths.set_gpu_path("auto")
    return timings


def around_the_switch() -> tuple[int, FakeCudaArray, FakeCudaArray]:
    """(the fake timings' switch in bytes, a float32 array just below it, one just above)."""
    switch = expected_table(range(SIZE))[1][0]
    small = FakeCudaArray.from_numpy(values_of(switch // 4 - 1, RANK, np.float32))
    big = FakeCudaArray.from_numpy(values_of(switch // 4 + 1, RANK, np.float32))
    return switch, small, big


@over_the_fakes
def test_calibration_gives_every_rank_one_table(checks, comm, fake_timings):
    """The first eligible call calibrates once; the slowest rank's times decide one table on
    every rank, and the calls follow it; calibrate() and the settings describe it."""
    calls = fake_timings.calls
    want = expected_table(range(SIZE))
    checks.check(len(want) == 2 and want[0] == (0, "direct"),
                 f"the fake timings give a switch: {want}")
    switch, small, big = around_the_switch()
    fastreduce.allreduce_(small)  # calibrates (collective)
    checks.check(len(calls) == 2 * len(calib.CALIBRATION_SIZES),
                 f"one calibration: {len(calls)} timings")
    _, log, paths = logged(lambda: fastreduce.allreduce_(small))
    checks.check(log["allreduce"]["device"] == 1 and paths["direct_calls"] == 1,
                 f"below the switch ({switch} bytes): direct, got {log} {paths}")
    _, log, paths = logged(lambda: fastreduce.allreduce_(big))
    checks.check(log["allreduce"]["device"] == 0 and paths["staged_calls"] == 1,
                 f"above the switch: staged, got {log} {paths}")
    tables = comm.allgather(calib._calibrated[-1][1])
    checks.check(all(list(t) == want for t in tables), f"every rank's table is {want}: {tables}")

    # calibrate() and fastreduce-info's settings describe it
    calibration = calib.calibrate(details=True)
    checks.check(list(calibration.table.steps) == want and len(calibration.direct) == len(
        calib.CALIBRATION_SIZES), f"calibrate(details=True): {calibration}")
    checks.check("calibrated" in gpupaths.gpu_path_settings()["size table"],
                 f"settings: {gpupaths.gpu_path_settings()}")


@over_the_fakes
def test_one_calibration_per_group(checks, comm, fake_timings):
    """A communicator of a calibrated group (a duplicate) is not calibrated again; another
    group is calibrated once, over its own ranks."""
    calls = fake_timings.calls
    _, small, big = around_the_switch()
    fastreduce.allreduce_(small)  # calibrates the world's group (collective)
    # the same group again (a duplicate communicator): no second calibration
    dup = fastreduce.default_comm().Dup()
    calls.clear()
    fastreduce.allreduce_(small, comm=dup)
    checks.check(not calls, f"a communicator of a calibrated group calibrated again: {calls}")
    # another group calibrates once, over its own ranks
    if comm.size > 1:
        half = comm.Split(RANK % 2, RANK)
        fastreduce.allreduce_(small, comm=half)
        fastreduce.allreduce_(big, comm=half)
        checks.check(len(calls) == 2 * len(calib.CALIBRATION_SIZES)
                     and all(c[0] == half.Get_size() for c in calls),
                     f"a new group: one calibration on its {half.Get_size()} ranks, "
                     f"got {len(calls)}")
        got = calib._calibrated[-1][1]  # fake_seconds slows the direct calls of half's rank 1
        checks.check(list(got) == expected_table(range(half.Get_size())),
                     f"half {RANK % 2}: {got}")
        half.Free()
    dup.Free()


# --- failures: one rank's error is every rank's CalibrationError -------------------------------

@over_the_fakes
@pytest.mark.parametrize(("where", "at", "done", "segment"), [
    ("direct", 4096, 0, None),            # before any call
    ("staged", 1 << 20, 4, None),         # half-way through a pipelined staged measurement
    ("direct", 1 << 20, 3, 64 << 10),     # half-way through 1 MiB cut into 64 KiB segments
], ids=["direct-before-any-call", "staged-half-way", "direct-segmented-half-way"])
def test_calibration_failure_on_one_rank(checks, comm, gpu_settings, fake_timings, where, at,
                                         done, segment):
    """The last rank fails timing `where` at `at` bytes after `done` of its calls (2 MPI calls
    a rep staged, 16 a rep in 64 KiB segments): every rank raises the same CalibrationError,
    naming the rank, the error and the way out."""

    def failing(comm, ptr, nbytes, path, reps):
        if comm.Get_rank() == SIZE - 1 and nbytes == at and path == where:
            REAL_MEASURE(comm, ptr, nbytes, path, done)  # part of the MPI calls made
            raise RuntimeError("fastreduce: CUDA cudaMemcpyAsync failed: injected (error 1)")
        return fake_timings(comm, ptr, nbytes, path, reps)

    old_segment = fastreduce.runtime.set_segment_bytes(
        segment if segment else fastreduce.runtime.segment_bytes())
    try:
        if where == "staged":
            checks.check(calib._call_counts(at, "staged") == [at // 8] * 2,
                         f"1 MiB staged is 2 MPI calls: {calib._call_counts(at, 'staged')}")
        if segment:
            checks.check(calib._call_counts(at, where) == [segment // 4] * 16,
                         f"1 MiB in 64 KiB segments: {calib._call_counts(at, where)}")
        gpu_settings.setattr(calib, "_measure", failing)
        # same members, another order: counts as calibrated (nothing is)
        fresh = fastreduce.default_comm().Create_group(fastreduce.default_comm().Get_group()
                                                       .Incl(list(range(SIZE))[::-1]))
        messages = []
        x = FakeCudaArray.from_numpy(values_of(10, RANK, np.float32))
        before = x.to_numpy()
        try:
            fastreduce.allreduce_(x, comm=fresh)
        except fastreduce.CalibrationError as exc:
            messages.append(str(exc))
        except Exception as exc:  # noqa: BLE001
            messages.append(f"wrong exception {exc!r}")
        everyone = comm.allgather(messages[0] if messages else None)
        checks.check(all(m is not None and m == everyone[0] for m in everyone),
                     f"failure in {where}: every rank raises the same CalibrationError: "
                     f"{everyone}")
        checks.check(everyone[0] is not None and f"failed on rank {SIZE - 1}" in everyone[0]
                     and "injected" in everyone[0]
                     and "FASTREDUCE_GPU_PATH=staged" in everyone[0],
                     f"the message names the rank, the error and the way out: {everyone[0]}")
        checks.check(np.array_equal(x.to_numpy(), before), "a failed calibration leaves x alone")
        fresh.Free()
    finally:
        fastreduce.runtime.set_segment_bytes(old_segment)


@over_the_fakes
def test_calibration_allocation_failure(checks, comm, gpu_settings, fake_timings):
    """An allocation failure on rank 0 is every rank's CalibrationError, naming it."""
    if RANK == 0:
        def no_memory(nbytes):
            raise RuntimeError("fastreduce: CUDA cudaMalloc failed: out of memory (error 2)")
        gpu_settings.setattr(_cuda, "device_alloc", no_memory)
    try:
        calib.calibrate()
        outcome = "no error"
    except fastreduce.CalibrationError as exc:
        outcome = str(exc)
    outcomes = comm.allgather(outcome)
    checks.check(all(o == outcomes[0] and "rank 0" in o and "cudaMalloc" in o for o in outcomes),
                 f"allocation failure on rank 0: {outcomes}")


@over_the_fakes
@pytest.mark.parametrize(("variable", "value", "words"), [
    ("FASTREDUCE_GPU_PATH", "fast", ["FASTREDUCE_GPU_PATH='fast'", "auto, direct, staged"]),
    ("FASTREDUCE_GPU_THRESHOLDS", "64KiB:direct", ["start at 0"]),
    ("FASTREDUCE_GPU_THRESHOLDS", "0:fast", ["SIZE:PATH"]),
    ("FASTREDUCE_DEVICE_POINTERS", "all", ["'none'", "blocking, nonblocking, 16bit"]),
    ("FASTREDUCE_GPU_THRESHOLDS_FILE", "/nonexistent/table", ["cannot be read"]),
], ids=["path-fast", "thresholds-not-from-0", "thresholds-bad-path", "device-pointers-all",
        "thresholds-file-missing"])
def test_bad_setting(checks, gpu_settings, fake_timings, variable, value, words):
    """A bad setting: the variable and the fix are named, nothing runs."""
    gpupaths.set_device_pointer_calls(None)
    gpu_settings.setenv(variable, value)
    gpupaths.set_gpu_path(None)
    x = FakeCudaArray.from_numpy(values_of(10, RANK, np.float32))
    checks.expect(ValueError, words, lambda: fastreduce.allreduce_(x), x)


@pytest.mark.mpi(ranks=(2, 3, 4), profile="fakecuda")
@pytest.mark.parametrize(("label", "variable", "value"), [
    ("disagree", "FASTREDUCE_GPU_PATH", "staged"),
    ("bad on rank 0", "FASTREDUCE_GPU_PATH", "fast"),
], ids=["disagree", "bad-on-rank-0"])
def test_settings_of_one_rank(checks, gpu_settings, fake_timings, label, variable, value):
    """Ranks that disagree, or one rank's bad setting: every rank raises, none hangs."""
    gpupaths.set_device_pointer_calls(None)
    if RANK == 0:
        gpu_settings.setenv(variable, value)
    gpupaths.set_gpu_path(None)
    x = FakeCudaArray.from_numpy(values_of(10, RANK, np.float32))
    if label == "disagree":
        words = ["disagree on the GPU path settings", "rank 0: mode staged",
                 "FASTREDUCE_GPU_PATH"]
    elif RANK == 0:
        words = ["FASTREDUCE_GPU_PATH='fast'"]
    else:
        words = ["rank 0 of this communicator has a bad GPU path setting", "'fast'"]
    checks.expect(ValueError, words, lambda: fastreduce.allreduce_(x), x)


# --- capture: nothing is queued on a stream that is capturing a CUDA graph ----------------------

CAPTURED_FORMS = {
    "allreduce_": lambda x: fastreduce.allreduce_(x),
    "allreduce": lambda x: fastreduce.allreduce(x),
    "iallreduce_": lambda x: fastreduce.iallreduce_(x),
    "coalesced": lambda x: fastreduce.allreduce_coalesced_([x]),
}


@pytest.fixture
def current_stream(gpu_settings):
    """A stream that is the current one until the case ends, and x written on it; staged
    mode, an MPI promising device pointers."""
    gpupaths.set_device_pointer_calls("blocking,nonblocking")
    gpupaths.set_gpu_path("staged")
    stream = Stream()
    fakecuda.set_current_stream(stream)
    x = FakeCudaTensor.from_numpy(values_of(1001, RANK, np.float32), stream=stream)
    stream.synchronize()
    yield stream, x
    fakecuda.set_current_stream(None)


@over_the_fakes
@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("form", CAPTURED_FORMS)
def test_call_while_capturing(checks, current_stream, form, mode):
    """A call on a stream capturing a CUDA graph raises before queueing anything, and the
    capture goes on undisturbed."""
    stream, x = current_stream
    fn = CAPTURED_FORMS[form]
    gpupaths.set_gpu_path(mode)
    fakecuda.reset_counters()
    stream.begin_capture()
    checks.expect(RuntimeError, ["captured into a CUDA graph", "outside the captured region"],
                  lambda: fn(x), x)
    status = stream.capture_status()
    checks.check(stream.end_capture() == 0 and status == fakecuda.CAPTURE_ACTIVE,
                 f"{form} ({mode}): the capture was disturbed")
    checks.check(fakecuda.counters()["capture_violations"] == 0, f"{form} ({mode}): queued work")


@over_the_fakes
def test_call_after_capture(checks, current_stream):
    """After a capture that refused a call ends, the call works."""
    stream, x = current_stream
    gpupaths.set_gpu_path("direct")
    stream.begin_capture()
    with contextlib.suppress(RuntimeError):
        fastreduce.allreduce_(x)
    stream.end_capture()
    fakecuda.set_current_stream(None)
    checks.check(np.array_equal(fastreduce.allreduce_(x).to_numpy(),
                                host_result(values_of(1001, RANK, np.float32), "sum")),
                 "after the capture ends, the call works")


# --- what each MPI promises (one rank, no fake) -------------------------------------------

OMPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022"
MPICH4 = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024\nMPICH ABI: 16:0:4"
MPICH3 = "MPICH Version:	3.4.3\nMPICH Release date:	Thu Dec 16 11:20:57 CST 2021"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)\nMPI BUILD INFO : ..."
MVAPICH_GDR = "MVAPICH2-GDR Version      :	2.3.7\nMVAPICH2 Release date	:	Mon May 16 2022"
MVAPICH_PLUS = "MVAPICH-Plus Version: 4.0\nMVAPICH Release date: 2024"
MVAPICH = "MVAPICH2 Version      :	2.3.7\nMVAPICH2 Release date	:	2022"
INTEL = "Intel(R) MPI Library 2021.11 for Linux* OS\n"
PROMISES = [  # id, text, environment, (blocking, non-blocking, 16-bit)
    ("open-mpi-4.1", OMPI, {}, (True, False, True)),
    ("open-mpi-5.0", "Open MPI v5.0.11, package: Open MPI Distribution", {},
     (True, False, True)),
    ("mpich-4.2", MPICH4, {}, (True, True, False)),
    ("mpich-3.4", MPICH3, {}, (True, False, False)),
    ("cray-gpu-on", CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, (True, True, False)),
    ("cray", CRAY, {}, (False, False, False)),
    ("cray-gpu-off", CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "0"}, (False, False, False)),
    ("mvapich2-gdr", MVAPICH_GDR, {}, (True, True, False)),
    ("mvapich-plus", MVAPICH_PLUS, {}, (True, True, False)),
    # plain MVAPICH2: unknown GPU support, blocking only
    ("mvapich2", MVAPICH, {}, (True, False, False)),
    ("intel-offload", INTEL, {"I_MPI_OFFLOAD": "1"}, (True, False, False)),
    ("intel", INTEL, {}, (False, False, False)),
    ("unknown", "Some Vendor MPI 2.0", {}, (True, False, False)),
]


@one_rank
@pytest.mark.parametrize(("text", "environ", "want"), [case[1:] for case in PROMISES],
                         ids=[case[0] for case in PROMISES])
def test_mpi_promises(checks, text, environ, want):
    """What the MPI's version text promises when CUDA-aware, and nothing when it is not."""
    got = mpi_promises(text, True, "test", environ)
    checks.check((got.blocking, got.nonblocking, got.half) == want,
                 f"{text.splitlines()[0]!r} {environ}: {got}, want {want}")
    checks.check(got.why and got.calls(),
                 f"{text!r}: says why ({got.why}) and what ({got.calls()})")
    off = mpi_promises(text, False, "MPIX_Query_cuda_support()", environ)
    checks.check((off.blocking, off.nonblocking, off.half) == (False, False, False)
                 and "cannot read GPU memory" in off.why and "MPIX_Query" in off.why,
                 f"{text!r}, not CUDA-aware: {off}")
    checks.check(off.calls() == "none", f"no calls in words: {off.calls()}")


@one_rank
def test_promised_calls_in_words(checks):
    """DevicePointerSupport.calls() says which calls, in words."""
    checks.check(mpi_promises(OMPI, True).calls()
                 == "blocking, 16-bit floats too (FASTREDUCE_HALF_OPS=mpi)",
                 mpi_promises(OMPI, True).calls())
    checks.check(mpi_promises(MPICH4, True).calls()
                 == "blocking and non-blocking (16-bit floats staged)",
                 mpi_promises(MPICH4, True).calls())


# --- sizes and size tables ---------------------------------------------------------------------

@one_rank
def test_parse_size(checks):
    """Sizes in bytes, K, M, G (KiB...), fractions; anything else is refused, named."""
    for text, want in (("4096", 4096), ("64K", 65536), ("64KiB", 65536), ("64kib", 65536),
                       ("1.5M", 3 << 19), ("2GiB", 2 << 30), ("16 MiB", 16 << 20), ("8B", 8)):
        checks.check(parse_size(text) == want,
                     f"parse_size({text!r}) = {parse_size(text)}, want {want}")
    for bad in ("", "K", "-4", "4X", "1.5.2M"):
        checks.expect(ValueError, [repr(bad), "K, M or G"], lambda bad=bad: parse_size(bad))


@one_rank
def test_path_table(checks):
    """PathTable: parsed from a setting or a file, written back, choosing by size; a bad
    table is refused, saying what to write."""
    table = PathTable.parse("0:direct, 64KiB:staged,16MiB:direct")
    checks.check(table.steps == ((0, "direct"), (65536, "staged"), (16 << 20, "direct")),
                 f"{table}")
    checks.check(table.spec() == "0:direct,64KiB:staged,16MiB:direct", table.spec())
    checks.check(PathTable.parse(table.spec()) == table, "spec() reads back")
    for nbytes, want in ((0, "direct"), (65535, "direct"), (65536, "staged"),
                         ((16 << 20) - 1, "staged"), (16 << 20, "direct"),
                         (1 << 40, "direct")):
        checks.check(table.path_for(nbytes) == want,
                     f"path_for({nbytes}) = {table.path_for(nbytes)}")
    checks.check(PathTable.parse("staged").steps == ((0, "staged"),) and
                 PathTable.parse("direct").spec() == "direct", "single paths")
    checks.check(PathTable.parse("# from our cluster\n0:staged # small\n,1000:direct\n").steps
                 == ((0, "staged"), (1000, "direct")), "comments and lines in a file")
    checks.check(PathTable.parse("# one step a line\n0:direct\n64KiB:staged\n\n1MiB:direct\n")
                 .steps == ((0, "direct"), (65536, "staged"), (1 << 20, "direct")),
                 "one step a line")
    checks.check(PathTable.parse("FASTREDUCE_GPU_THRESHOLDS=0:direct,4KiB:staged\n").steps
                 == ((0, "direct"), (4096, "staged")),
                 "fastreduce-info --calibrate's line as it is")
    for bad, words in (("64KiB:direct", ["start at 0"]),
                       ("0:direct,4K:staged,1K:direct", ["increase"]),
                       ("0:direct,0:staged", ["increase"]), ("0:fast", ["SIZE:PATH"]),
                       ("fast", ["SIZE:PATH"]), ("0-direct", ["SIZE:PATH"]),
                       ("", ["SIZE:PATH"])):
        checks.expect(ValueError, ["GPU path table", *words],
                      lambda bad=bad: PathTable.parse(bad, "X"))


# --- settings ----------------------------------------------------------------------------------

@one_rank
def test_gpu_path_mode_setting(checks, gpu_settings):
    """auto by default; FASTREDUCE_GPU_PATH, any case; set_gpu_path() wins; a bad mode named."""
    checks.check(gpupaths.gpu_path_mode() == ("auto", "default"),
                 f"default mode {gpupaths.gpu_path_mode()}")
    gpu_settings.setenv("FASTREDUCE_GPU_PATH", "Staged")
    checks.check(gpupaths.gpu_path_mode() == ("staged", "FASTREDUCE_GPU_PATH"),
                 "mode from the environment")
    gpupaths.set_gpu_path("direct")
    checks.check(gpupaths.gpu_path_mode()[0] == "direct", "set_gpu_path wins over the environment")
    gpupaths.set_gpu_path(None)
    gpu_settings.delenv("FASTREDUCE_GPU_PATH")
    checks.expect(ValueError, ["'fastest'", "auto, direct, staged"],
                  lambda: gpupaths.set_gpu_path("fastest"))


@one_rank
def test_pinned_thresholds_setting(checks, gpu_settings):
    """Nothing pinned by default; FASTREDUCE_GPU_THRESHOLDS pins, not with ..._FILE too;
    set_gpu_thresholds() wins."""
    checks.check(gpupaths.pinned_thresholds() is None, "nothing pinned by default")
    gpu_settings.setenv("FASTREDUCE_GPU_THRESHOLDS", "0:direct,1MiB:staged")
    checks.check(gpupaths.pinned_thresholds().steps == ((0, "direct"), (1 << 20, "staged")),
                 "pinned by env")
    gpu_settings.setenv("FASTREDUCE_GPU_THRESHOLDS_FILE", "/tmp/x")
    checks.expect(ValueError, ["both", "set one"], gpupaths.pinned_thresholds)
    gpu_settings.delenv("FASTREDUCE_GPU_THRESHOLDS_FILE")
    gpupaths.set_gpu_thresholds("staged")
    checks.check(gpupaths.pinned_thresholds().spec() == "staged", "set_gpu_thresholds wins")


@one_rank
def test_device_pointers_setting(checks, gpu_settings):
    """FASTREDUCE_DEVICE_POINTERS overrides the table; set_device_pointer_calls() wins; a bad
    list is named."""
    gpu_settings.setenv("FASTREDUCE_DEVICE_POINTERS", "blocking, 16bit")
    got = gpupaths.device_pointer_support()
    checks.check((got.blocking, got.nonblocking, got.half) == (True, False, True)
                 and "FASTREDUCE_DEVICE_POINTERS" in got.why, f"override by env: {got}")
    gpu_settings.setenv("FASTREDUCE_DEVICE_POINTERS", "none")
    checks.check(gpupaths.device_pointer_support().calls() == "none", "none")
    gpupaths.set_device_pointer_calls(["blocking", "nonblocking"])
    got = gpupaths.device_pointer_support()
    checks.check((got.blocking, got.nonblocking, got.half) == (True, True, False), f"set: {got}")
    gpupaths.set_device_pointer_calls(None)
    gpu_settings.delenv("FASTREDUCE_DEVICE_POINTERS")
    checks.expect(ValueError, ["'blocking,everything'", "'none'"],
                  lambda: gpupaths.set_device_pointer_calls("blocking,everything"))


@one_rank
def test_gpu_path_settings_in_words(checks, gpu_settings):
    """gpu_path_settings(), for fastreduce-info: the mode, the device pointers, the table."""
    settings = gpupaths.gpu_path_settings()
    checks.check(set(settings) == {"mode", "device pointers", "size table"}, f"{settings}")
    checks.check("first eligible call" in settings["size table"], f"{settings}")
