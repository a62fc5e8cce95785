"""fastreduce on torch CUDA tensors (the staged path) on 2 and 4 ranks sharing the GPUs.

Needs torch with CUDA and a GPU; skipped otherwise. The MPI need not be CUDA-aware: the
worker forces the staged path (device -> pinned host -> MPI -> device). Run only these
with `python -m pytest -m gpu`.
"""

from __future__ import annotations

import functools

import pytest
from mpirun import run_workers

pytestmark = pytest.mark.gpu

TIMEOUT = 480  # seconds per job; the worker takes well under 2 minutes on 4 ranks, 1 GPU


@functools.cache
def _no_cuda_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (f"no usable CUDA device: torch {torch.__version__} (CUDA "
                f"{torch.version.cuda or 'none: a CPU build'}) says "
                f"torch.cuda.is_available() is False")
    return None


def require_cuda() -> None:
    reason = _no_cuda_reason()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_cuda_tensors(nprocs):
    """Every dtype x op x shape x form vs the CPU path, stream ordering (with a check that
    can fail), copy counts, coalesced, bad input, layers and GradientSync on CUDA."""
    require_cuda()
    out = run_workers("gpu_torch.py", nprocs, timeout=TIMEOUT)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_cuda_tensors_on_the_paths_this_mpi_allows(nprocs):
    """The same checks with the path fastreduce chooses for the MPI in use: with a CUDA-aware
    MPI, direct calls (no copies) where it promises them, never a non-blocking one it does
    not; with any other MPI, the staged path again."""
    require_cuda()
    out = run_workers("gpu_torch.py", nprocs, "--as-detected", "--sections",
                      "matrix,ordering,visible,layers,gradsync", timeout=TIMEOUT)
    assert f"on {nprocs} ranks, 0 failed" in out


def test_gradient_sync_broadcasts_cuda_parameters():
    """GradientSync(model) on a CUDA model (broadcast_parameters=True, the default) copies
    rank 0's parameters to every rank with an MPI that cannot read GPU memory. A job of its
    own: handing a device pointer to such an MPI crashes the process."""
    require_cuda()
    out = run_workers("gpu_torch.py", 2, "--sections", "gradsync_broadcast", timeout=TIMEOUT)
    assert "on 2 ranks, 0 failed" in out


def test_bench_times_every_gpu_path_mode():
    """fastreduce-bench --device cuda --gpu-paths auto,direct,staged: one job, a path beside
    every size, no wrong element."""
    require_cuda()
    import re
    import sys

    from mpirun import run_mpi

    rc, out = run_mpi(2, sys.executable, "-m", "fastreduce.bench", "--device", "cuda",
                      "--gpu-paths", "auto,direct,staged", "-b", "4", "-e", "4M", "-f", "16",
                      timeout=TIMEOUT)
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +\d+ ", line)]
    assert len(rows) == 6 and all(r[9] == "0" for r in rows), out
    assert all(r[10] in ("direct", "staged") and r[14] == "staged" for r in rows), out


def test_train_step_bench_on_the_gpu():
    """bench/train_step_bench.py --device cuda on a small model: every variant runs."""
    require_cuda()
    import sys
    from pathlib import Path

    from mpirun import run_mpi

    script = str(Path(__file__).resolve().parents[1] / "bench" / "train_step_bench.py")
    rc, out = run_mpi(2, sys.executable, script, "--device", "cuda", "--width", "512",
                      "--depth", "2", "--steps", "3", "--repeat", "1", timeout=TIMEOUT)
    assert rc == 0 and "GradientSync / DDP gloo" in out, out
