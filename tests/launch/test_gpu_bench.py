"""The GPU benchmarks, launched on 2 ranks sharing the GPUs: fastreduce-bench's GPU path
modes, every collective of fastreduce-bench -c on CUDA, and bench/train_step_bench.py on
CUDA.

Needs torch with CUDA and a GPU; skipped otherwise. Run only these with
`python -m pytest -m gpu`.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.one_mpi]

TIMEOUT = 480  # seconds per job


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


def test_bench_times_every_gpu_path_mode():
    """fastreduce-bench --device cuda --gpu-paths auto,direct,staged: one job, a path beside
    every size, no wrong element."""
    require_cuda()
    rc, out = run_mpi(2, sys.executable, "-m", "fastreduce.bench", "--device", "cuda",
                      "--gpu-paths", "auto,direct,staged", "-b", "4", "-e", "4M", "-f", "16",
                      timeout=TIMEOUT)
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +\d+ ", line)]
    assert len(rows) == 6 and all(r[9] == "0" for r in rows), out
    assert all(r[10] in ("direct", "staged") and r[14] == "staged" for r in rows), out


@pytest.mark.parametrize("collective", ["broadcast", "reduce", "allgather", "reduce_scatter",
                                        "alltoall", "gather", "scatter"])
def test_bench_times_every_collective_on_the_gpu(collective):
    """fastreduce-bench -c COLLECTIVE --device cuda --gpu-paths auto,staged: a row per size
    with the path taken, no wrong element, the by-hand staged column beside it."""
    require_cuda()
    rc, out = run_mpi(2, sys.executable, "-m", "fastreduce.bench", "-c", collective,
                      "--device", "cuda", "--gpu-paths", "auto,staged", "-b", "4",
                      "-e", "4M", "-f", "64", timeout=TIMEOUT)
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +\d+ ", line)]
    assert len(rows) == 4 and all(r[9] == "0" for r in rows), out
    assert all(r[10] in ("direct", "staged") and r[12] == "staged" for r in rows), out
    assert "mpi4py(us)" in out, out


def test_train_step_bench_on_the_gpu():
    """bench/train_step_bench.py --device cuda on a small model: every variant runs."""
    require_cuda()
    script = str(Path(__file__).resolve().parents[2] / "bench" / "train_step_bench.py")
    rc, out = run_mpi(2, sys.executable, script, "--device", "cuda", "--width", "512",
                      "--depth", "2", "--steps", "3", "--repeat", "1", timeout=TIMEOUT)
    assert rc == 0 and "GradientSync / DDP gloo" in out, out
