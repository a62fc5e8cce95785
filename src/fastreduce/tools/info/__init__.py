"""fastreduce-info: what fastreduce was built with and runs on, for bug reports.

    mpiexec -n 2 fastreduce-info              (or: srun -n 2 python -m fastreduce.info)
    mpiexec -n 2 fastreduce-info --calibrate  time the GPU paths, print the size table
"""

from __future__ import annotations

import os
import platform
import sys

import mpi4py
import numpy
from mpi4py import MPI

from ... import algorithms, gpupaths, runtime, settings, topology
from ..._abi import first_line
from ..._version import __version__
from ...backend import (
    buffer,
    collectives,
    cudart,
    engine,
    mpierrors,
    reduce,
    reductions,
    variants,
)
from ...errors import CalibrationError
from ...sizes import format_size

__all__ = ["collect", "main"]


def collect() -> dict:
    """Every field fastreduce-info prints, for this rank."""
    family, version = mpierrors.build_mpi()
    thread_names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                    MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    aware, how = gpupaths.cuda_aware()
    try:
        import torch  # optional: fastreduce works without it

        torch_version = torch.__version__
        exchange = buffer._uses_exchange_api(torch.empty(0))
        exchange_text = "yes (DLPack C exchange API)" if exchange else "no (__dlpack__ fallback)"
        try:
            from ...torch.distributed import BACKEND
        except ImportError as exc:  # torch older than the backend needs
            backend = f"n/a ({exc})"
        else:
            backend = (f"{BACKEND!r} for cpu and cuda (fastreduce {__version__}): "
                       f"import fastreduce.distributed; dist.init_process_group({BACKEND!r})")
    except ImportError:
        torch_version, exchange_text = "not installed", "n/a (torch not installed)"
        backend = "n/a (torch not installed)"
    try:
        cuda_runtime = cudart.find_runtime()
    except RuntimeError:
        cuda_runtime = "none found (GPU tensors unavailable; set FASTREDUCE_CUDART)"
    world = MPI.COMM_WORLD
    nodes = topology.gather()
    try:
        plan = algorithms.plan()
        steps = ", ".join(f"{name} from {format_size(start)}" if start else name
                          for start, name in plan["steps"])
        algorithm = (f"{algorithms.algorithm_mode()}: {steps} (FASTREDUCE_ALGORITHM, "
                     f"FASTREDUCE_ALGORITHM_TABLE)")
    except ValueError as exc:  # a bad or disagreeing setting: say which
        algorithm, plan = str(exc), {"segment_bytes": runtime.segment_bytes()}
    try:
        paths = gpupaths.gpu_path_settings()
    except ValueError as exc:  # a bad setting: say which
        paths = dict.fromkeys(("mode", "device pointers", "size table"), str(exc))
    return {
        "fastreduce": __version__,
        "python": platform.python_version(),
        "mpi4py": mpi4py.__version__,
        "numpy": numpy.__version__,
        "torch": torch_version,
        "built against": f"{version} ({family} ABI)",
        "compiled core": variants.in_use(),
        "running on": first_line(MPI.Get_library_version()),
        "linked libmpi": first_line(mpierrors.linked_library_version()),
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
        "thread level": thread_names.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "large counts": "MPI_Allreduce_c" if collectives.HAVE_LARGE_COUNT else "chunked",
        "algorithm": algorithm,
        "segments": _segments(runtime.segment_bytes() if reduce.segment_bytes_pinned()
                              else plan["segment_bytes"]),
        **_tcp_links(family, nodes),
        "16-bit floats": "; ".join(f"{k}: {v}"
                                   for k, v in reductions.half_precision_paths().items()),
        "CUDA-aware": f"{'yes' if aware else 'no'} ({how})",
        "CUDA runtime": cuda_runtime,
        "GPU path": paths["mode"],
        "device pointers": paths["device pointers"],
        "GPU size table": paths["size table"],
        "progress engine": _engine_state(),
        "torch buffers": exchange_text,
        "torch.distributed": backend,
        "rank": world.Get_rank(),
        "size": world.Get_size(),
        "local rank": runtime.local_rank(),
        "local size": runtime.local_size(),
        "host": MPI.Get_processor_name(),
        "nodes": nodes.summary(),
        "node ranks": nodes.listing(),
        **({"topology": "WARNING: processor names and shared-memory groups disagree: "
                        + "; ".join(nodes.problems)} if nodes.problems else {}),
    }


def _tcp_links(family: str, nodes) -> dict:
    """Open MPI across nodes: how many TCP connections join two ranks (one connection
    carrying both directions of a busy link gets about half of it: docs/cluster.md)."""
    if family != "Open MPI" or nodes.nodes < 2:
        return {}
    links = os.environ.get("OMPI_MCA_btl_tcp_links")
    if links and links.strip() not in ("", "1"):
        return {"TCP links": f"{links.strip()} per peer (OMPI_MCA_btl_tcp_links)"}
    return {"TCP links": "1 per peer: one connection can get about half a busy link both "
                         "ways; OMPI_MCA_btl_tcp_links=2 may help (measured: back-to-back "
                         "exchanges, not training steps; docs/algorithms.md)"}


def _engine_state() -> str:
    try:
        on, why = engine.state()
        if not on:
            return why
        host = engine.host_bytes()
        hosts = ("no host requests" if host < 0 else "every host request" if host == 0
                 else f"host requests of {format_size(host)} and more")
        return f"{why}: non-blocking staged GPU requests, {hosts} (FASTREDUCE_ENGINE_HOST_BYTES)"
    except ValueError as exc:
        return str(exc)


def _segments(nbytes: int) -> str:
    if nbytes == 0:
        return "off: one MPI call per blocking all-reduce (FASTREDUCE_SEGMENT_BYTES=0)"
    return (f"blocking all-reduces above {format_size(nbytes)} go one {format_size(nbytes)} "
            f"segment per MPI call (FASTREDUCE_SEGMENT_BYTES)")


PER_RANK = ("rank", "local rank", "local size", "host")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--calibrate"]):
        print("usage: fastreduce-info [--calibrate]   (run it under mpiexec or srun)",
              file=sys.stderr)
        return 2
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
        _print_settings()
        sys.stdout.flush()
    if argv == ["--calibrate"]:
        return calibrate_and_print()
    return 0


def _print_settings() -> None:
    """Every setting (fastreduce.settings): its text in the environment, or its default."""
    rows = settings.describe()
    width = max(len(name) for name, _, _ in rows)
    print("settings:")
    for name, shown, _ in rows:
        print(f"  {name:<{width}} : {shown}")


def calibrate_and_print() -> int:
    """Time both GPU paths on every rank's GPU (local rank % devices); rank 0 prints the
    timings and the size table. Collective; exit status 1 on every rank if it fails."""
    world = MPI.COMM_WORLD
    problem = None
    try:
        cudart.set_device(runtime.local_rank() % cudart.device_count())
    except (RuntimeError, ValueError) as exc:
        problem = str(exc)
    problems = [p for p in world.allgather(problem) if p]
    if problems:
        if world.Get_rank() == 0:
            print(f"fastreduce-info: cannot calibrate: {problems[0]}", file=sys.stderr)
        return 1
    try:
        result = gpupaths.calibrate(collectives.default_comm(), details=True)
    except (CalibrationError, ValueError) as exc:
        if world.Get_rank() == 0:
            print(f"fastreduce-info: {exc}", file=sys.stderr)
        return 1
    if world.Get_rank() == 0:
        print(f"# GPU path calibration on {world.Get_size()} ranks: float32 sum, "
              f"slowest rank's median (us)")
        if result.sizes:
            print(f"#{'size(B)':>11} {'direct':>10} {'staged':>10} {'chosen':>8}")
            for n, d, s in zip(result.sizes, result.direct, result.staged, strict=True):
                print(f" {n:>11} {d * 1e6:10.2f} {s * 1e6:10.2f} "
                      f"{result.table.path_for(n):>8}")
        else:
            print(f"# {result.table.source}")
        print(f"FASTREDUCE_GPU_THRESHOLDS={result.table.spec()}")
        sys.stdout.flush()
    return 0

