"""The import-time check that fastreduce and mpi4py use the same MPI library."""

import importlib.util
import sys
import types
from pathlib import Path

import pytest


def load_pure_modules():
    """fastreduce/_abi.py and fastreduce/backend/variants.py (which it imports), loaded
    without importing fastreduce (which initialises MPI): under a package name of their own
    whose parents are empty modules."""
    spec = importlib.util.find_spec("fastreduce")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    for name in ("fr_pure", "fr_pure.backend"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
    loaded = []
    for name, path in (("fr_pure.backend.variants", root / "backend" / "variants.py"),
                       ("fr_pure._abi", root / "_abi.py")):
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
        loaded.append(module)
    return loaded


variants, abi = load_pure_modules()
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


# --- a wheel's builds, one per ABI family: which one loads -----------------------------------

@pytest.mark.parametrize(("loaded", "want"), [(OMPI, "openmpi"), (MPICH, "mpich"),
                                               (INTEL, "mpich"), (CRAY, "mpich")])
def test_the_build_for_the_loaded_family(loaded, want):
    assert variants.choose(["mpich", "openmpi"], loaded, None) == want


def test_no_build_for_the_loaded_family():
    with pytest.raises(ImportError) as info:
        variants.choose(["openmpi"], MPICH, None)
    text = str(info.value)
    assert all(w in text for w in ("MPICH Version:      5.0.2 (ABI family: MPICH)",
                                   "openmpi (Open MPI) only", "MPI4PY_LIBMPI",
                                   "--no-binary fastreduce")), text
    with pytest.raises(ImportError, match=r"Microsoft MPI 10.1 \(ABI family: unknown\)"):
        variants.choose(["mpich", "openmpi"], "Microsoft MPI 10.1", None)


def test_forced_build():
    """FASTREDUCE_MPIABI names the build for an MPI whose family cannot be told; it may
    not name one of another family than the one loaded, nor one the wheel lacks."""
    assert variants.choose(["mpich", "openmpi"], "Vendor MPI 3.0", "mpich") == "mpich"
    assert variants.choose(["mpich", "openmpi"], MPICH, "mpich") == "mpich"
    with pytest.raises(ImportError, match="names the MPICH build, but mpi4py loaded Open MPI"):
        variants.choose(["mpich", "openmpi"], OMPI, "mpich")
    with pytest.raises(ImportError, match="FASTREDUCE_MPIABI=mpich, but this installation "
                                          "holds the compiled core for openmpi"):
        variants.choose(["openmpi"], "Vendor MPI 3.0", "mpich")


def test_variants_found_in_a_folder(tmp_path):
    """Only folders holding the compiled core count; a source build has it in place."""
    from importlib.machinery import EXTENSION_SUFFIXES

    (tmp_path / "_openmpi").mkdir()
    (tmp_path / "_openmpi" / f"collectives{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    (tmp_path / "_mpich").mkdir()
    (tmp_path / "_mpich" / "collectives.pyi").write_text("")  # a stub is no build
    assert variants.variants_in(str(tmp_path)) == ["openmpi"]
    assert variants.use_variant([str(tmp_path / "_openmpi")]) is None  # in place


def maps(*paths: str) -> str:
    """A /proc/self/maps text mapping these files (and an anonymous region)."""
    lines = ["7f00000000-7f00001000 rw-p 00000000 00:00 0 "]
    lines += [f"7f{i:08x}-7f{i + 1:08x} r-xp 00000000 fd:01 {1000 + i}  {p}"
              for i, p in enumerate(paths)]
    return "\n".join(lines)


@pytest.mark.parametrize("library", [
    "/venv/lib/libmpi.so.12",  # the MPICH wheel, MPICH, MVAPICH
    "/usr/lib/x86_64-linux-gnu/libmpich.so.12.2.2",  # Debian's and Ubuntu's MPICH
    "/opt/intel/mpi/lib/release/libmpi.so.12.0.0",  # Intel MPI
    "/opt/cray/pe/mpich/lib/libmpi_gnu_123.so.12",  # Cray MPICH
    "/opt/dir with spaces/libmpi.so.12",
])
def test_the_mpich_library_in_the_memory_map(library):
    found = variants.mpich_library_in(maps("/usr/lib/libc.so.6",
                                           "/usr/lib/x86_64-linux-gnu/libmpichcxx.so.12",
                                           library, "/usr/lib/libm.so.6"))
    assert found == library


@pytest.mark.parametrize("library", ["/usr/lib/x86_64-linux-gnu/libmpi.so.40.30.5",
                                     "/usr/lib/x86_64-linux-gnu/libmpichfort.so.12",
                                     "/usr/lib/libmpi.so.120"])
def test_no_mpich_library_in_the_memory_map(library):
    assert variants.mpich_library_in(maps(library)) is None


def test_an_mpich_build_with_no_mpich_library_loaded():
    with pytest.raises(ImportError, match=r"no MPICH-family libmpi \(libmpi.so.12, "
                       r"libmpich.so.12\) is in this process; make mpi4py load one"):
        variants.share_mpich_library(maps("/usr/lib/x86_64-linux-gnu/libmpi.so.40"))
