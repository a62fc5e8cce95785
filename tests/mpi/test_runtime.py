"""Node-local rank, the CUDA-aware answer and the Horovod layer's settings, under mpiexec.

The test_launcher_agnostic_* cases (core all-reduce and node-local rank, whatever launched
us: mpiexec or srun) also run across nodes; cuda_aware()'s order of answers, with fake MPI
answers, runs on one rank.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

import fastreduce
from fastreduce import settings
from fastreduce.backend import mpierrors as _errors
from fastreduce.errors import SettingError
from fastreduce.gpupaths import capabilities


def launcher_agnostic(case):
    """The rank counts of the old test_launcher_agnostic_core, across nodes too."""
    return pytest.mark.across_nodes(pytest.mark.mpi(ranks=(1, 3))(case))


one_rank = pytest.mark.mpi(ranks=1)


@pytest.fixture
def cuda_aware_restored():
    """set_cuda_aware(None) again after the case."""
    yield
    fastreduce.set_cuda_aware(None)


# --- core all-reduce and node-local rank, whatever launched us ----------------------------

@launcher_agnostic
def test_launcher_agnostic_allreduce(checks, comm):
    """allreduce of a float64 torch tensor (and which MPI launched us, on rank 0)."""
    p, rank = comm.size, comm.rank
    x = torch.arange(6, dtype=torch.float64) * (rank + 1)
    checks.check(torch.equal(fastreduce.allreduce(x), torch.arange(6, dtype=torch.float64)
                             * p * (p + 1) / 2), "allreduce")
    if rank == 0:
        print("launched with", fastreduce.build_mpi(), flush=True)


@launcher_agnostic
def test_launcher_agnostic_allreduce_numpy(checks, comm):
    """allreduce_ max of an int32 numpy array."""
    a = np.full(3, comm.rank, dtype=np.int32)
    fastreduce.allreduce_(a, "max")
    checks.check(np.array_equal(a, np.full(3, comm.size - 1)), "allreduce_ max numpy")


@launcher_agnostic
def test_launcher_agnostic_local_rank(checks, comm):
    """The node-local rank from the hostnames: ranks that share a host share a node."""
    rank = comm.rank
    hosts = comm.allgather(socket.gethostname())
    local, local_size = hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank])
    checks.check(fastreduce.local_rank() == local and fastreduce.local_size() == local_size,
                 f"local rank {fastreduce.local_rank()}/{fastreduce.local_size()}")


@launcher_agnostic
def test_launcher_agnostic_iallreduce(checks, comm):
    """iallreduce of a float32 torch tensor."""
    req = fastreduce.iallreduce(torch.ones(4))
    checks.check(torch.equal(req.wait(), torch.full((4,), float(comm.size))), "iallreduce")


# --- cuda_aware(): the order of the answers ----------------------------------------------

@one_rank
def test_cuda_aware_default_answer(checks, monkeypatch):
    """With no setting, the MPI's own query answers, saying how."""
    monkeypatch.delenv("FASTREDUCE_CUDA_AWARE", raising=False)
    answer, how = fastreduce.cuda_aware()
    checks.check(isinstance(answer, bool) and how, f"default answer {answer}, {how}")
    checks.check(("MPIX_" in how) == (_errors.mpi_cuda_query() is not None), f"how: {how}")


@one_rank
def test_cuda_aware_setting_and_switch(checks, monkeypatch, cuda_aware_restored):
    """FASTREDUCE_CUDA_AWARE answers, set_cuda_aware() wins over it, a bad value is named."""
    monkeypatch.setenv("FASTREDUCE_CUDA_AWARE", "1")
    checks.check(fastreduce.cuda_aware() == (True, "FASTREDUCE_CUDA_AWARE"), "env 1")
    monkeypatch.setenv("FASTREDUCE_CUDA_AWARE", "0")
    checks.check(fastreduce.cuda_aware() == (False, "FASTREDUCE_CUDA_AWARE"), "env 0")
    fastreduce.set_cuda_aware(True)  # the Python switch wins over the environment
    checks.check(fastreduce.cuda_aware() == (True, "fastreduce.set_cuda_aware()"), "switch")
    fastreduce.set_cuda_aware(None)
    monkeypatch.setenv("FASTREDUCE_CUDA_AWARE", "yes")
    checks.expect(ValueError, ["FASTREDUCE_CUDA_AWARE='yes'", "0 or 1"], fastreduce.cuda_aware)


@one_rank
def test_cuda_aware_memory_kinds(checks, monkeypatch):
    """With no vendor query, the MPI 4.1 memory-kinds info decides; with neither, no."""
    monkeypatch.delenv("FASTREDUCE_CUDA_AWARE", raising=False)
    monkeypatch.setattr(_errors, "mpi_cuda_query", lambda: None)
    for kinds, want in [("system,mpi,cuda:device", True), ("system,cuda", True),
                        ("system,mpi", False), (None, False)]:
        monkeypatch.setattr(capabilities, "_memory_alloc_kinds", lambda kinds=kinds: kinds)
        got, how = fastreduce.cuda_aware()
        checks.check(got is want, f"kinds {kinds!r}: {got} ({how})")
    monkeypatch.setattr(_errors, "mpi_cuda_query",
                        lambda: (True, "MPIX_Query_cuda_support()"))
    checks.check(fastreduce.cuda_aware() == (True, "MPIX_Query_cuda_support()"),
                 "vendor query")


# --- the HOROVOD_* variables fastreduce.horovod reads, through the settings table ------------

@one_rank
def test_horovod_settings(checks):
    """HOROVOD_FUSION_THRESHOLD, HOROVOD_TIMELINE(_MARK_CYCLES) and
    HOROVOD_DYNAMIC_PROCESS_SETS parse as fastreduce.horovod read them."""
    def value(name, text=None):
        return settings.value(name, {} if text is None else {name: text})

    fusion = "HOROVOD_FUSION_THRESHOLD"
    checks.check(value(fusion) == 25 << 20 and value(fusion, " ") == 25 << 20,
                 f"fusion default: {value(fusion)}")
    checks.check(value(fusion, "0") == 0 and value(fusion, " 4096 ") == 4096, "fusion bytes")
    for bad in ("-1", "1M", "lots"):
        checks.expect(SettingError, [f"{fusion}={bad!r}", ">= 0"],
                      lambda bad=bad: value(fusion, bad))
    dynamic = [value("HOROVOD_DYNAMIC_PROCESS_SETS", t) for t in (None, "", "0", "1", "yes")]
    checks.check(dynamic == [False, False, False, True, True], f"dynamic sets: {dynamic}")
    marks = [value("HOROVOD_TIMELINE_MARK_CYCLES", t) for t in (None, "0", "1", "yes")]
    checks.check(marks == [False, False, True, False], f"mark cycles: {marks}")
    checks.check(value("HOROVOD_TIMELINE") is None
                 and value("HOROVOD_TIMELINE", " t.json ") == "t.json", "timeline path")
