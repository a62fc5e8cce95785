"""allreduce / allreduce_ on 1-4 ranks: every dtype x op x shape x mode, torch and numpy."""

import pytest
from mpirun import run_workers

RANKS = [1, 2, 3, 4]


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("nprocs", RANKS)
def test_matrix(nprocs, framework):
    out = run_workers("allreduce_matrix.py", nprocs, framework)
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_over_one_mib(nprocs, framework):
    out = run_workers("allreduce_matrix.py", nprocs, framework, "--big")
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_counts_above_the_int_limit(nprocs, framework):
    """A lowered limit sends every tensor over 5 elements through MPI_Allreduce_c
    (MPI-4 large counts) or, where the MPI lacks it, through chunks."""
    out = run_workers("allreduce_matrix.py", nprocs, framework, "--count-limit", "5")
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_segmented(nprocs, framework):
    """16-byte segments: every tensor of several elements goes in many MPI calls (counted),
    the results match the reference and are bit-identical on every rank."""
    out = run_workers("allreduce_matrix.py", nprocs, framework, "--segment-bytes", "16")
    assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_segmented_with_the_int_limit(nprocs):
    """Segments below and above a lowered int-count limit: whichever is smaller cuts."""
    for segment in ("8", "64"):
        out = run_workers("allreduce_matrix.py", nprocs, "numpy", "--count-limit", "5",
                          "--segment-bytes", segment)
        assert f"on {nprocs} ranks, 0 failed" in out


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_segments_over_one_mib(framework):
    """The default segment size on tensors of a few MiB, and segmentation off."""
    for segment in ("1048576", "0"):
        out = run_workers("allreduce_matrix.py", 3, framework, "--big", "--segment-bytes",
                          segment)
        assert "on 3 ranks, 0 failed" in out


def _available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


@pytest.mark.skipif(_available_gib() < 8, reason="needs about 2.2 GiB a rank (8 GiB free)")
def test_more_than_2_to_the_31_elements():
    """allreduce_ of 2**31 + 4097 int8 on 2 ranks: the count does not fit an int."""
    out = run_workers("large_count.py", 2, timeout=600)
    assert "on 2 ranks, 0 failed" in out
