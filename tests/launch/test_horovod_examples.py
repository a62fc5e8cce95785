"""The Horovod examples (examples/horovod/) run unchanged on 2 MPI ranks and make progress."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

pytestmark = pytest.mark.one_mpi  # its subject does not depend on the MPI family

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "horovod"
BENCHMARK = EXAMPLES / "pytorch_synthetic_benchmark.py"
MNIST = EXAMPLES / "pytorch_mnist.py"


def run_example(script: Path, *args: str) -> str:
    """`script` on 2 ranks under `python -m mpi4py`; its output, failing on a non-zero exit."""
    rc, out = run_mpi(2, sys.executable, "-m", "mpi4py", str(script), *args, timeout=180)
    assert rc == 0, f"{script.name} {' '.join(args)} exited with {rc}:\n{out}"
    return out


@pytest.mark.parametrize("extra", [[], ["--fp16-allreduce", "--depth", "10"]],
                         ids=["float32", "fp16"])
def test_synthetic_benchmark(extra):
    out = run_example(BENCHMARK, "--num-iters", "3", *extra)
    assert "Number of CPUs: 2" in out and out.count("Running benchmark...") == 1, out
    rates = [float(r) for r in re.findall(r"^Iter #\d+: ([\d.]+) img/sec per CPU$", out, re.M)]
    assert len(rates) == 3 and all(r > 0 for r in rates), out  # rank 0 alone prints
    total = re.search(r"^Total img/sec on 2 CPU\(s\): ([\d.]+) \+-[\d.]+$", out, re.M)
    assert total and float(total[1]) > 0, out


def losses(out: str) -> list[tuple[float, float]]:
    """(test loss, accuracy %) per epoch, epoch 0 being before training."""
    found = re.findall(r"Test set \(epoch \d+\): Average loss: ([\d.]+), Accuracy: ([\d.]+)%",
                       out)
    return [(float(loss), float(acc)) for loss, acc in found]


@pytest.mark.parametrize("extra", [
    [],
    ["--fp16-allreduce", "--gradient-predivide-factor", "2", "--epochs", "2"],
], ids=["float32", "fp16-predivide"])
def test_mnist_loss_decreases(extra):
    out = run_example(MNIST, *extra)
    epochs = 2 if "--epochs" in extra else 3
    results = losses(out)
    assert len(results) == epochs + 1, out  # rank 0 alone prints
    (first_loss, first_acc), (last_loss, last_acc) = results[0], results[-1]
    assert last_loss < 0.8 * first_loss and last_acc > first_acc + 20, out
