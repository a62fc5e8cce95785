"""fastreduce.gpupath's table of MPI promises, size tables and settings (1 rank)."""

from __future__ import annotations

import os

from common import Failures

from fastreduce import gpupath, runtime
from fastreduce.gpupath import PathTable, mpi_promises, parse_size

fails = Failures()
check, expect = fails.check, fails.expect

# --- what each MPI promises ----------------------------------------------------------------
OMPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022"
MPICH4 = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024\nMPICH ABI: 16:0:4"
MPICH3 = "MPICH Version:	3.4.3\nMPICH Release date:	Thu Dec 16 11:20:57 CST 2021"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)\nMPI BUILD INFO : ..."
MVAPICH_GDR = "MVAPICH2-GDR Version      :	2.3.7\nMVAPICH2 Release date	:	Mon May 16 2022"
MVAPICH_PLUS = "MVAPICH-Plus Version: 4.0\nMVAPICH Release date: 2024"
MVAPICH = "MVAPICH2 Version      :	2.3.7\nMVAPICH2 Release date	:	2022"
INTEL = "Intel(R) MPI Library 2021.11 for Linux* OS\n"
cases = [  # text, environment, (blocking, non-blocking, 16-bit)
    (OMPI, {}, (True, False, True)),
    ("Open MPI v5.0.11, package: Open MPI Distribution", {}, (True, False, True)),
    (MPICH4, {}, (True, True, False)),
    (MPICH3, {}, (True, False, False)),
    (CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, (True, True, False)),
    (CRAY, {}, (False, False, False)),
    (CRAY, {"MPICH_GPU_SUPPORT_ENABLED": "0"}, (False, False, False)),
    (MVAPICH_GDR, {}, (True, True, False)),
    (MVAPICH_PLUS, {}, (True, True, False)),
    (MVAPICH, {}, (True, False, False)),  # plain MVAPICH2: unknown GPU support, blocking only
    (INTEL, {"I_MPI_OFFLOAD": "1"}, (True, False, False)),
    (INTEL, {}, (False, False, False)),
    ("Some Vendor MPI 2.0", {}, (True, False, False)),
]
for text, environ, want in cases:
    got = mpi_promises(text, True, "test", environ)
    check((got.blocking, got.nonblocking, got.half) == want,
          f"{text.splitlines()[0]!r} {environ}: {got}, want {want}")
    check(got.why and got.calls(), f"{text!r}: says why ({got.why}) and what ({got.calls()})")
    off = mpi_promises(text, False, "MPIX_Query_cuda_support()", environ)
    check((off.blocking, off.nonblocking, off.half) == (False, False, False)
          and "cannot read GPU memory" in off.why and "MPIX_Query" in off.why,
          f"{text!r}, not CUDA-aware: {off}")
    check(off.calls() == "none", f"no calls in words: {off.calls()}")
check(mpi_promises(OMPI, True).calls() == "blocking, 16-bit floats too (FASTREDUCE_HALF_OPS=mpi)",
      mpi_promises(OMPI, True).calls())
check(mpi_promises(MPICH4, True).calls() == "blocking and non-blocking (16-bit floats staged)",
      mpi_promises(MPICH4, True).calls())

# --- sizes and size tables ---------------------------------------------------------------------
for text, want in (("4096", 4096), ("64K", 65536), ("64KiB", 65536), ("64kib", 65536),
                   ("1.5M", 3 << 19), ("2GiB", 2 << 30), ("16 MiB", 16 << 20), ("8B", 8)):
    check(parse_size(text) == want, f"parse_size({text!r}) = {parse_size(text)}, want {want}")
for bad in ("", "K", "-4", "4X", "1.5.2M"):
    expect(ValueError, [repr(bad), "K, M or G"], lambda bad=bad: parse_size(bad))

table = PathTable.parse("0:direct, 64KiB:staged,16MiB:direct")
check(table.steps == ((0, "direct"), (65536, "staged"), (16 << 20, "direct")), f"{table}")
check(table.spec() == "0:direct,64KiB:staged,16MiB:direct", table.spec())
check(PathTable.parse(table.spec()) == table, "spec() reads back")
for nbytes, want in ((0, "direct"), (65535, "direct"), (65536, "staged"), ((16 << 20) - 1,
                     "staged"), (16 << 20, "direct"), (1 << 40, "direct")):
    check(table.path_for(nbytes) == want, f"path_for({nbytes}) = {table.path_for(nbytes)}")
check(PathTable.parse("staged").steps == ((0, "staged"),) and
      PathTable.parse("direct").spec() == "direct", "single paths")
check(PathTable.parse("# from our cluster\n0:staged # small\n,1000:direct\n").steps
      == ((0, "staged"), (1000, "direct")), "comments and lines in a file")
check(PathTable.parse("# one step a line\n0:direct\n64KiB:staged\n\n1MiB:direct\n").steps
      == ((0, "direct"), (65536, "staged"), (1 << 20, "direct")), "one step a line")
check(PathTable.parse("FASTREDUCE_GPU_THRESHOLDS=0:direct,4KiB:staged\n").steps
      == ((0, "direct"), (4096, "staged")), "fastreduce-info --calibrate's line as it is")
for bad, words in (("64KiB:direct", ["start at 0"]), ("0:direct,4K:staged,1K:direct",
                   ["increase"]), ("0:direct,0:staged", ["increase"]), ("0:fast", ["SIZE:PATH"]),
                   ("fast", ["SIZE:PATH"]), ("0-direct", ["SIZE:PATH"]), ("", ["SIZE:PATH"])):
    expect(ValueError, ["GPU path table", *words], lambda bad=bad: PathTable.parse(bad, "X"))

# --- settings ----------------------------------------------------------------------------------
for variable in ("FASTREDUCE_GPU_PATH", "FASTREDUCE_GPU_THRESHOLDS",
                 "FASTREDUCE_GPU_THRESHOLDS_FILE", "FASTREDUCE_DEVICE_POINTERS"):
    os.environ.pop(variable, None)
check(gpupath.gpu_path_mode() == ("auto", "default"), f"default mode {gpupath.gpu_path_mode()}")
os.environ["FASTREDUCE_GPU_PATH"] = "Staged"
check(gpupath.gpu_path_mode() == ("staged", "FASTREDUCE_GPU_PATH"), "mode from the environment")
runtime.set_gpu_path("direct")
check(gpupath.gpu_path_mode()[0] == "direct", "set_gpu_path wins over the environment")
runtime.set_gpu_path(None)
del os.environ["FASTREDUCE_GPU_PATH"]
expect(ValueError, ["'fastest'", "auto, direct, staged"], lambda: runtime.set_gpu_path("fastest"))

check(gpupath.pinned_thresholds() is None, "nothing pinned by default")
os.environ["FASTREDUCE_GPU_THRESHOLDS"] = "0:direct,1MiB:staged"
check(gpupath.pinned_thresholds().steps == ((0, "direct"), (1 << 20, "staged")), "pinned by env")
os.environ["FASTREDUCE_GPU_THRESHOLDS_FILE"] = "/tmp/x"
expect(ValueError, ["both", "set one"], gpupath.pinned_thresholds)
del os.environ["FASTREDUCE_GPU_THRESHOLDS_FILE"]
runtime.set_gpu_thresholds("staged")
check(gpupath.pinned_thresholds().spec() == "staged", "set_gpu_thresholds wins")
runtime.set_gpu_thresholds(None)
del os.environ["FASTREDUCE_GPU_THRESHOLDS"]

os.environ["FASTREDUCE_DEVICE_POINTERS"] = "blocking, 16bit"
got = gpupath.device_pointer_support()
check((got.blocking, got.nonblocking, got.half) == (True, False, True)
      and "FASTREDUCE_DEVICE_POINTERS" in got.why, f"override by env: {got}")
os.environ["FASTREDUCE_DEVICE_POINTERS"] = "none"
check(gpupath.device_pointer_support().calls() == "none", "none")
runtime.set_device_pointer_calls(["blocking", "nonblocking"])
got = gpupath.device_pointer_support()
check((got.blocking, got.nonblocking, got.half) == (True, True, False), f"set: {got}")
runtime.set_device_pointer_calls(None)
del os.environ["FASTREDUCE_DEVICE_POINTERS"]
expect(ValueError, ["'blocking,everything'", "'none'"],
       lambda: runtime.set_device_pointer_calls("blocking,everything"))

settings = gpupath.gpu_path_settings()
check(set(settings) == {"mode", "device pointers", "size table"}, f"{settings}")
check("first eligible call" in settings["size table"], f"{settings}")
fails.finish()
