"""fastreduce-info: what fastreduce was built with and runs on, for bug reports.

    mpiexec -n 2 fastreduce-info        (or: srun -n 2 python -m fastreduce.info)
"""

from __future__ import annotations

import platform
import sys

from ._abi import first_line

__all__ = ["collect", "main"]


def collect() -> dict:
    """Every field fastreduce-info prints, for this rank."""
    from mpi4py import MPI

    import fastreduce
    from fastreduce import _buffer, _cuda, _errors, runtime

    family, version = _errors.build_mpi()
    thread_names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                    MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    aware, how = runtime.cuda_aware()
    try:
        import torch

        torch_version = torch.__version__
        exchange = _buffer._uses_exchange_api(torch.empty(0))
        exchange_text = "yes (DLPack C exchange API)" if exchange else "no (__dlpack__ fallback)"
    except ImportError:
        torch_version, exchange_text = "not installed", "n/a (torch not installed)"
    try:
        cuda_runtime = _cuda.find_runtime()
    except RuntimeError:
        cuda_runtime = "none found (GPU tensors unavailable; set FASTREDUCE_CUDART)"
    world = MPI.COMM_WORLD
    return {
        "fastreduce": fastreduce.__version__,
        "python": platform.python_version(),
        "mpi4py": __import__("mpi4py").__version__,
        "numpy": __import__("numpy").__version__,
        "torch": torch_version,
        "built against": f"{version} ({family} ABI)",
        "running on": first_line(MPI.Get_library_version()),
        "linked libmpi": first_line(_errors.linked_library_version()),
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
        "thread level": thread_names.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "large counts": "MPI_Allreduce_c" if fastreduce.HAVE_LARGE_COUNT else "chunked",
        "16-bit floats": "; ".join(f"{k}: {v}"
                                   for k, v in fastreduce.half_precision_paths().items()),
        "CUDA-aware": f"{'yes' if aware else 'no'} ({how})",
        "CUDA runtime": cuda_runtime,
        "torch buffers": exchange_text,
        "rank": world.Get_rank(),
        "size": world.Get_size(),
        "local rank": runtime.local_rank(),
        "local size": runtime.local_size(),
        "host": MPI.Get_processor_name(),
    }


PER_RANK = ("rank", "local rank", "local size", "host")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print("usage: fastreduce-info   (takes no arguments; run it under mpiexec or srun)",
              file=sys.stderr)
        return 2
    from mpi4py import MPI

    fields = collect()
    ranks = MPI.COMM_WORLD.gather({k: fields[k] for k in PER_RANK})
    if fields["rank"] == 0:
        width = max(len(k) for k in fields)
        for key, value in fields.items():
            if key not in PER_RANK:
                print(f"{key:>{width}} : {value}")
        print(f"{'ranks':>{width}} : " + ", ".join(
            f"{r['rank']}@{r['host']} (local {r['local rank']}/{r['local size']})"
            for r in ranks))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
