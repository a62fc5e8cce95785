"""Check that fastreduce and mpi4py talk to the same MPI library."""

from __future__ import annotations

from .backend.variants import first_line, mpi_family

__all__ = ["check", "first_line", "mismatch", "mpi_family"]


def mismatch(build: tuple[str, str], linked: str, loaded: str) -> str | None:
    """Why fastreduce cannot use the MPI that mpi4py loaded, or None when it can.

    `build`: (family, version) of the headers fastreduce was compiled with;
    `linked`: the library version fastreduce's own libmpi reports;
    `loaded`: the library version mpi4py reports.
    """
    family, version = build
    loaded_family = mpi_family(loaded)
    rebuild = (
        "Rebuild fastreduce against the MPI that mpi4py loads: put that MPI's mpicc first "
        "on PATH (or set MPICC) and run `pip install --no-build-isolation --force-reinstall "
        "--no-deps .` in the fastreduce source tree; or make mpi4py load the MPI fastreduce "
        "was built with (mpi4py's MPI4PY_LIBMPI setting)."
    )
    if family != "unknown" and loaded_family != "unknown" and family != loaded_family:
        return (
            f"fastreduce was built against {version} ({family} ABI) but mpi4py loaded "
            f"{first_line(loaded)} ({loaded_family} ABI); their handles are incompatible. "
            + rebuild
        )
    if linked.replace("\0", "").strip() != loaded.replace("\0", "").strip():
        return (
            f"two MPI libraries are loaded in this process: fastreduce calls "
            f"{first_line(linked)} while mpi4py calls {first_line(loaded)}. " + rebuild
        )
    return None


def check() -> None:
    """Raise ImportError when fastreduce's MPI is not the one mpi4py has loaded."""
    # Imported here, not at the top: the rest of this module is pure text handling, which
    # tools and tests load without initialising MPI or loading the compiled core.
    from mpi4py import MPI

    from .backend import mpierrors

    problem = mismatch(
        mpierrors.build_mpi(), mpierrors.linked_library_version(), MPI.Get_library_version()
    )
    if problem is not None:
        raise ImportError("fastreduce: " + problem)
