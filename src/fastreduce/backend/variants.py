"""Which build of the compiled core this process loads.

A source build puts the compiled core's modules in this package, built against the MPI
whose mpicc built it. A wheel holds one build per MPI ABI family, each in a folder of its
own (``_openmpi``: libmpi.so.40, Open MPI; ``_mpich``: MPICH and its derivatives: Intel
MPI, MVAPICH, Cray MPICH, whose library is libmpi.so.12 or, in Debian's and Ubuntu's MPICH,
libmpich.so.12, so that build names none and takes the one mpi4py loaded), and loads the
one for the MPI that mpi4py loaded (``FASTREDUCE_MPIABI`` names one instead). The choice is
`choose`, a pure function; `use_variant` applies it to the package's path before any of
its modules is imported.
"""

from __future__ import annotations

import ctypes
import os
import re
from importlib.machinery import EXTENSION_SUFFIXES

__all__ = ["FAMILY_OF_VARIANT", "choose", "first_line", "in_use", "mpi_family",
           "mpich_library_in", "share_mpich_library", "use_variant", "variants_in"]

# A variant's folder name (without the leading "_") and the ABI family it serves.
FAMILY_OF_VARIANT = {"openmpi": "Open MPI", "mpich": "MPICH"}
_MPICH_FAMILY_MARKERS = ("MPICH", "Intel(R) MPI", "MVAPICH", "CRAY MPICH")
_PROBE = "collectives"  # an extension module every build has
# An MPICH-family libmpi: libmpi.so.12 (MPICH, Intel MPI, MVAPICH), libmpich.so.12 (Debian's
# and Ubuntu's MPICH), libmpi_<compiler>.so.12 (Cray MPICH); not libmpichcxx, libmpichfort.
_MPICH_LIBRARY = re.compile(r"/lib(mpi|mpich)(_[A-Za-z0-9_]+)?\.so\.12(\.[0-9.]+)?$")
_in_use: str | None = None


def mpi_family(library_version: str) -> str:
    """ABI family ("Open MPI", "MPICH" or "unknown") of an MPI_Get_library_version string."""
    if "Open MPI" in library_version:
        return "Open MPI"
    if any(marker in library_version for marker in _MPICH_FAMILY_MARKERS):
        return "MPICH"
    return "unknown"


def first_line(text: str) -> str:
    """The first line of an MPI_Get_library_version string (some MPIs count the NUL)."""
    text = text.replace("\0", "").strip()
    return text.splitlines()[0].strip() if text else "(empty)"


def choose(available: list[str], loaded: str, forced: str | None) -> str:
    """The variant to load from those a wheel holds, for the MPI library version mpi4py
    reports (`loaded`), or the one `forced` (FASTREDUCE_MPIABI) names; ImportError naming
    what was found and what to do where none fits."""
    held = ", ".join(f"{v} ({FAMILY_OF_VARIANT.get(v, '?')})" for v in sorted(available))
    family = mpi_family(loaded)
    if forced:
        if forced not in available:
            raise ImportError(
                f"fastreduce: FASTREDUCE_MPIABI={forced}, but this installation holds the "
                f"compiled core for {held}; name one of those, or unset it")
        if family != "unknown" and FAMILY_OF_VARIANT[forced] != family:
            raise ImportError(
                f"fastreduce: FASTREDUCE_MPIABI={forced} names the {FAMILY_OF_VARIANT[forced]} "
                f"build, but mpi4py loaded {first_line(loaded)} ({family} ABI): their handles "
                f"are incompatible; unset FASTREDUCE_MPIABI (it is for an MPI whose family "
                f"fastreduce cannot tell)")
        return forced
    for variant in sorted(available):
        if FAMILY_OF_VARIANT.get(variant) == family:
            return variant
    raise ImportError(
        f"fastreduce: mpi4py loaded {first_line(loaded)} (ABI family: {family}), and this "
        f"installation holds the compiled core for {held} only. Make mpi4py load an MPI of "
        f"one of those families (mpi4py's MPI4PY_LIBMPI), or build fastreduce against this "
        f"MPI from source: with its mpicc first on PATH, `pip install --no-binary fastreduce "
        f"fastreduce`")


def mpich_library_in(maps: str) -> str | None:
    """The path of the MPICH-family libmpi in a process's memory map (/proc/self/maps'
    text), or None."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _MPICH_LIBRARY.search(fields[5].strip()):
            return fields[5].strip()
    return None


def share_mpich_library(maps: str) -> str:
    """Make the symbols of the MPICH-family libmpi in `maps` (/proc/self/maps' text: the
    one mpi4py loaded) global, for the MPICH build, which names no libmpi (MPICH's own is
    libmpi.so.12, Debian's libmpich.so.12); returns its path."""
    path = mpich_library_in(maps)
    if path is None:
        raise ImportError(
            "fastreduce: the wheel's MPICH build takes MPI from the library mpi4py loaded, and "
            "no MPICH-family libmpi (libmpi.so.12, libmpich.so.12) is in this process; make "
            "mpi4py load one (mpi4py's MPI4PY_LIBMPI), or build fastreduce from source")
    ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    return path


def _memory_map() -> str:
    try:
        with open("/proc/self/maps") as maps:
            return maps.read()
    except OSError:  # not Linux: the wheel is Linux's
        return ""


def _has_core(folder: str) -> bool:
    """Whether the compiled core's modules are in folder (not only their stubs)."""
    return any(os.path.exists(os.path.join(folder, _PROBE + suffix))
               for suffix in EXTENSION_SUFFIXES)


def variants_in(folder: str) -> list[str]:
    """The builds a wheel put in the package's folder (none: a source build)."""
    found = []
    for variant in FAMILY_OF_VARIANT:
        where = os.path.join(folder, f"_{variant}")
        if os.path.isdir(where) and _has_core(where):
            found.append(variant)
    return found


def use_variant(path: list[str]) -> str | None:
    """Put the build to load first on the package's `path` (a wheel's; MPI's library
    version read through mpi4py); None where the modules are in place (a source build)."""
    global _in_use
    folder = path[0]
    if _has_core(folder):
        return None
    found = variants_in(folder)
    if not found:
        return None  # nothing built: the first import says so
    from mpi4py import MPI  # the library it loaded is the one fastreduce must use

    _in_use = choose(found, MPI.Get_library_version(),
                     os.environ.get("FASTREDUCE_MPIABI") or None)
    if _in_use == "mpich":
        share_mpich_library(_memory_map())
    path.insert(0, os.path.join(folder, f"_{_in_use}"))
    return _in_use


def in_use() -> str:
    """Which build is loaded, in words (for fastreduce-info)."""
    if _in_use is None:
        return "built from source"
    return f"the wheel's {_in_use} build ({FAMILY_OF_VARIANT[_in_use]} ABI)"
