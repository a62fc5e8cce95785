"""cuda_aware(): the order of the answers, with fake MPI answers; local_rank under mpiexec."""

import os

from common import Failures

import fastreduce
from fastreduce import gpupath
from fastreduce.backend import mpierrors as _errors

fails = Failures()
os.environ.pop("FASTREDUCE_CUDA_AWARE", None)
answer, how = fastreduce.cuda_aware()
fails.check(isinstance(answer, bool) and how, f"default answer {answer}, {how}")
fails.check(("MPIX_" in how) == (_errors.mpi_cuda_query() is not None), f"how: {how}")

os.environ["FASTREDUCE_CUDA_AWARE"] = "1"
fails.check(fastreduce.cuda_aware() == (True, "FASTREDUCE_CUDA_AWARE"), "env 1")
os.environ["FASTREDUCE_CUDA_AWARE"] = "0"
fails.check(fastreduce.cuda_aware() == (False, "FASTREDUCE_CUDA_AWARE"), "env 0")
fastreduce.set_cuda_aware(True)  # the Python switch wins over the environment
fails.check(fastreduce.cuda_aware() == (True, "fastreduce.set_cuda_aware()"), "switch")
fastreduce.set_cuda_aware(None)
os.environ["FASTREDUCE_CUDA_AWARE"] = "yes"
fails.expect(ValueError, ["FASTREDUCE_CUDA_AWARE='yes'", "0 or 1"], fastreduce.cuda_aware)
del os.environ["FASTREDUCE_CUDA_AWARE"]

# with no vendor query, the MPI 4.1 memory-kinds info decides; with neither, no
real_query, real_kinds = _errors.mpi_cuda_query, gpupath._memory_alloc_kinds
_errors.mpi_cuda_query = lambda: None
for kinds, want in [("system,mpi,cuda:device", True), ("system,cuda", True),
                    ("system,mpi", False), (None, False)]:
    gpupath._memory_alloc_kinds = lambda kinds=kinds: kinds
    got, how = fastreduce.cuda_aware()
    fails.check(got is want, f"kinds {kinds!r}: {got} ({how})")
_errors.mpi_cuda_query = lambda: (True, "MPIX_Query_cuda_support()")
fails.check(fastreduce.cuda_aware() == (True, "MPIX_Query_cuda_support()"), "vendor query")
_errors.mpi_cuda_query, gpupath._memory_alloc_kinds = real_query, real_kinds
fails.finish()
