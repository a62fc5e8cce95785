"""One message size: fastreduce timed in each GPU path mode, the correctness check, then
each peer; for the other collectives (-c), fastreduce's call, its check, then each peer."""

from __future__ import annotations

import numpy as np

import fastreduce

from . import collectives
from .peers import _time_collective_peer, _time_peer
from .reference import _rounded, as_numpy, expected, fill, make_buffer, rank_values
from .timing import _iterations, _time_mode


def _measure(args, comm, count: int, nbytes: int, p: int, peers, gloo,
             step=lambda what: None, floor=None) -> dict:
    """One size: every column's timing, and the correctness check; step(what) names each
    part as it starts (rank 0's status line)."""
    x = make_buffer(args.buffers, args.dtype, count, args.device)
    iters, warmup = _iterations(args, nbytes)
    op = args.op
    if args.nonblocking:
        start = fastreduce.iallreduce if args.out_of_place else fastreduce.iallreduce_

        def call():
            start(x, op, comm=comm).wait()
    elif args.out_of_place:
        def call():
            fastreduce.allreduce(x, op, comm=comm)
    else:
        def call():
            fastreduce.allreduce_(x, op, comm=comm)
    modes = {}
    for mode in (args.gpu_modes if args.device == "cuda" else ["auto"]):
        step(f"fastreduce ({mode})" if mode and len(args.gpu_modes) > 1 else "fastreduce")
        modes[mode] = _time_mode(args, comm, call, iters, warmup, mode)
    main = modes[args.gpu_modes[0] if args.device == "cuda" else "auto"]
    times = main["times"]
    avg = sum(times) / len(times)
    bus = 2 * (p - 1) / p if p > 1 else 0.0
    row = {"bytes": nbytes, "count": count, "avg_us": avg * 1e6, "min_us": min(times) * 1e6,
           "max_us": max(times) * 1e6, "algbw": nbytes / avg / 1e9,
           "busbw": nbytes / avg / 1e9 * bus, "peers": {}}
    if args.device == "cuda":
        row["path"] = main["path"]
        row["modes"] = {m: {"avg_us": sum(v["times"]) / len(v["times"]) * 1e6,
                            "path": v["path"]} for m, v in modes.items()}
    # correctness after timing
    step("checking")
    fill(x, rank_values(args.dtype, op, comm.Get_rank(), count))
    if args.nonblocking:
        result = start(x, op, comm=comm).wait()
    elif args.out_of_place:
        result = fastreduce.allreduce(x, op, comm=comm)
    else:
        result = fastreduce.allreduce_(x, op, comm=comm)
    got = as_numpy(result).astype(np.float64 if args.dtype != "bool" else bool)
    want = expected(args.dtype, op, p, count)
    if args.dtype not in ("bool",):
        want = as_numpy(_rounded(args.buffers, args.dtype, want)).astype(np.float64)
    if args.inject_wrong and comm.Get_rank() == 0:
        got = got.copy()
        got[0] = not got[0] if got.dtype == bool else got[0] + 1
    mine = int(np.count_nonzero(got != want))
    row["wrong"] = comm.allreduce(mine)
    for name in peers:
        step(name)
        row["peers"][name] = _time_peer(name, args, comm, count, iters, warmup, gloo,
                                        call, floor) * 1e6
    return row


def _measure_collective(args, comm, count: int, nbytes: int, p: int, peers, gloo,
                        step=lambda what: None, floor=None) -> dict:
    """One row of a collective other than the all-reduce (-c): count and nbytes as
    collectives.rows_for gives them (nccl-tests' count and size); on a GPU timed in each
    path mode; the same fields as _measure's rows."""
    case = collectives.Case(args.collective, args.buffers, args.dtype, count, comm,
                            args.device)
    iters, warmup = _iterations(args, nbytes)
    call = collectives.fastreduce_call(case, args.op, comm)
    modes = {}
    for mode in (args.gpu_modes if args.device == "cuda" else [None]):
        step(f"fastreduce ({mode})" if mode and len(args.gpu_modes) > 1 else "fastreduce")
        modes[mode] = _time_mode(args, comm, call, iters, warmup, mode)
    main = modes[args.gpu_modes[0] if args.device == "cuda" else None]
    times = main["times"]
    avg = sum(times) / len(times)
    row = {"bytes": nbytes, "count": count, "avg_us": avg * 1e6, "min_us": min(times) * 1e6,
           "max_us": max(times) * 1e6, "algbw": nbytes / avg / 1e9,
           "busbw": nbytes / avg / 1e9 * collectives.bus_factor(args.collective, p),
           "peers": {}}
    if args.device == "cuda":
        row["path"] = main["path"]
        row["modes"] = {m: {"avg_us": sum(v["times"]) / len(v["times"]) * 1e6,
                            "path": v["path"]} for m, v in modes.items()}
    step("checking")
    row["wrong"] = comm.allreduce(collectives.check(case, args.op, comm, args.inject_wrong))
    del case  # its memory back before the peers allocate theirs
    for name in peers:
        step(name)
        row["peers"][name] = _time_collective_peer(name, args, comm, count, iters, warmup,
                                                   gloo, floor) * 1e6
    return row
