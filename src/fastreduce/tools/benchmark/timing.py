"""Timed loops: iteration counts, device synchronisation, seconds per call on each rank."""

from __future__ import annotations

import time

from ... import gpupaths


def _iterations(args, nbytes: int) -> tuple[int, int]:
    iters = args.iters or (1000 if nbytes <= 64 << 10 else
                           max(10, 100 * (1 << 20) // max(nbytes, 1 << 20)))
    return iters, args.warmup or max(2, iters // 10)


def _time(comm, fn, iters: int, warmup: int, device: str = "cpu") -> float:
    """Seconds per fn() on this rank; on a GPU, until the device has finished the work."""
    sync = _device_sync(device)
    for _ in range(warmup):
        fn()
    sync()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def _device_sync(device: str):
    if device == "cpu":
        return lambda: None
    import torch  # optional and heavy: loaded only when used

    return torch.cuda.synchronize


def _time_mode(args, comm, call, iters: int, warmup: int, mode: str) -> dict:
    """Every rank's seconds per call in a GPU path mode (None: the one in force), and the
    path the timed calls took: direct, staged, or mixed (from fastreduce's path counters)."""
    if args.device != "cuda":
        return {"times": comm.allgather(_time(comm, call, iters, warmup)), "path": ""}
    if mode is not None:
        gpupaths.set_gpu_path(mode)
    try:
        for _ in range(warmup):  # a calibration (auto, first use) happens here, untimed
            call()
        gpupaths.reset_gpu_copy_counts()
        t = _time(comm, call, iters, 0, args.device)
        counts = gpupaths.gpu_copy_counts()
    finally:
        if mode is not None:
            gpupaths.set_gpu_path(None)
    direct = comm.allreduce(counts["direct_calls"])
    staged = comm.allreduce(counts["staged_calls"])
    path = "mixed" if direct and staged else "direct" if direct else "staged"
    return {"times": comm.allgather(t), "path": path}
