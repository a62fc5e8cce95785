"""The import-time check that fastreduce and mpi4py use the same MPI library."""

import importlib.util
from pathlib import Path

import pytest


def load_abi_module():
    """fastreduce/_abi.py, loaded without importing fastreduce (which initialises MPI)."""
    spec = importlib.util.find_spec("fastreduce")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "_abi.py"
    module_spec = importlib.util.spec_from_file_location("fastreduce_abi_under_test", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


abi = load_abi_module()
OMPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\nMPICH ABI: 18:2:"
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.15 (ANL base 3.4a2)"


@pytest.mark.parametrize(
    "text, family",
    [(OMPI, "Open MPI"), (MPICH, "MPICH"), (INTEL, "MPICH"), (CRAY, "MPICH"),
     ("MVAPICH2 Version 2.3.7", "MPICH"), ("Microsoft MPI 10.1", "unknown")],
)
def test_family(text, family):
    assert abi.mpi_family(text) == family


def test_same_library_passes():
    assert abi.mismatch(("Open MPI", "Open MPI 5.0.11"), OMPI, OMPI) is None
    assert abi.mismatch(("MPICH", "MPICH 5.0.2"), MPICH, MPICH) is None


def test_other_family_is_named_with_the_fix():
    problem = abi.mismatch(("Open MPI", "Open MPI 5.0.11"), MPICH, MPICH)
    assert "built against Open MPI 5.0.11 (Open MPI ABI)" in problem
    assert "mpi4py loaded MPICH Version:      5.0.2 (MPICH ABI)" in problem
    assert "MPICC" in problem and "pip install" in problem


def test_two_libraries_in_one_process():
    other = OMPI.replace("5.0.11", "5.0.9")
    problem = abi.mismatch(("Open MPI", "Open MPI 5.0.11"), other, OMPI)
    assert "two MPI libraries are loaded" in problem
    assert "5.0.9" in problem and "5.0.11" in problem


def test_unknown_vendors_compare_the_library_strings():
    assert abi.mismatch(("unknown", "unknown MPI"), "X MPI 1", "X MPI 1") is None
    assert abi.mismatch(("unknown", "unknown MPI"), "X MPI 1", "Y MPI 2") is not None


def test_library_strings_with_a_counted_nul():
    # Open MPI counts the terminating NUL in MPI_Get_library_version's length
    assert abi.first_line(OMPI + "\0") == OMPI
    assert abi.mismatch(("Open MPI", "Open MPI 5.0.11"), OMPI, OMPI + "\0") is None
