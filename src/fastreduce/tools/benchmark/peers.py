"""The columns beside fastreduce: the C floor, mpi4py, torch.distributed (gloo, or
fastreduce's own backend) and fastreduce with segmentation off, and setting up
torch.distributed for them."""

from __future__ import annotations

import socket

import numpy as np
from mpi4py import MPI

from ... import runtime
from . import collectives
from .timing import _time

PEERS = ("c", "mpi4py", "torch", "torch-fastreduce", "unsegmented")
# the peers of the collectives other than the all-reduce, and those they show by default
COLLECTIVE_PEERS = ("c", "mpi4py", "torch", "torch-fastreduce")
DEFAULT_COLLECTIVE_PEERS = ("c", "mpi4py")


def _torch_version() -> str:
    try:
        import torch  # optional and heavy: loaded only when used
    except ImportError:
        return "not installed"
    return torch.__version__


def _init_torch(world, peers) -> dict | None:
    """torch.distributed for the torch peers: {peer: its process group}, or None."""
    if "torch-fastreduce" not in peers:
        return {"torch": init_gloo(world)} if "torch" in peers else None
    import torch.distributed as dist  # optional and heavy: loaded only when used

    from ...torch import distributed  # noqa: F401  (registers the backend)

    dist.init_process_group("fastreduce")
    groups = {"torch-fastreduce": dist.group.WORLD}
    if "torch" in peers:
        groups["torch"] = dist.new_group(backend="gloo")
    return groups


def init_gloo(world):
    """torch.distributed's default group on gloo over the ranks of world (a TCP rendezvous
    at rank 0, its address and a free port shared through MPI); returns the group."""
    import torch.distributed as dist  # optional and heavy: loaded only when used

    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port)
    host = world.bcast(socket.gethostname() if world.Get_rank() == 0 else None)
    address = "127.0.0.1" if host == socket.gethostname() else host
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())
    return dist.group.WORLD


def _time_peer(name: str, args, comm, count: int, iters: int, warmup: int, gloo,
               call=None, floor=None) -> float:
    """Seconds per all-reduce of one peer, averaged over the ranks."""
    if name == "c":  # MPI_Allreduce in a C loop on host memory, in place or not as timed
        case = collectives.numpy_case("allreduce", args.dtype, count, comm)
        if args.out_of_place:
            case.out = np.zeros_like(case.x)
        t = collectives.c_timer(floor, case, args.op, comm)(warmup, iters)
    elif name == "unsegmented":  # fastreduce's own call with one MPI call per all-reduce
        old = runtime.set_segment_bytes(0)
        try:
            t = _time(comm, call, iters, warmup, args.device)
        finally:
            runtime.set_segment_bytes(old)  # None: unpinned again (each plan decides)
    elif name == "mpi4py":
        ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
               "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR, "avg": MPI.SUM}
        dtype = "float32" if args.dtype == "bfloat16" else args.dtype
        if args.device == "cpu":
            buf = np.zeros(count, dtype=dtype)
            t = _time(comm, lambda: comm.Allreduce(MPI.IN_PLACE, buf, ops[args.op]), iters,
                      warmup)
        else:
            # what a user writes without fastreduce: copy to pinned host memory, mpi4py,
            # copy back (float32 standing in for bfloat16, as on the host)
            import torch  # optional and heavy: loaded only when used

            dev = torch.zeros(count, dtype=getattr(torch, dtype), device=args.device)
            host = torch.zeros(count, dtype=dev.dtype, pin_memory=True)
            view = host.numpy()

            def staged():
                host.copy_(dev)
                comm.Allreduce(MPI.IN_PLACE, view, ops[args.op])
                dev.copy_(host, non_blocking=True)

            t = _time(comm, staged, iters, warmup, args.device)
    else:
        import torch  # optional and heavy: loaded only when used
        import torch.distributed as dist  # optional and heavy: loaded only when used

        ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
               "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM,
               "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
        t_buf = torch.zeros(count, dtype=getattr(torch, args.dtype), device=args.device)
        # torch.distributed reduces over the whole world: with --partition this column
        # is the world-wide all-reduce, which the JSON says
        group = gloo[name]
        t = _time(comm, lambda: dist.all_reduce(t_buf, ops[args.op], group=group), iters,
                  warmup, args.device)
    return comm.allreduce(t) / comm.Get_size()


def _time_collective_peer(name: str, args, comm, count: int, iters: int, warmup: int, gloo,
                          floor) -> float:
    """Seconds per call of one peer of a collective other than the all-reduce (-c), on
    buffers of its own, averaged over the ranks: the C floor and mpi4py on numpy arrays
    (--device cuda: mpi4py on pinned copies of the CUDA tensors, staged by hand),
    torch.distributed on tensors."""
    if name == "c":
        case = collectives.numpy_case(args.collective, args.dtype, count, comm)
        t = collectives.c_timer(floor, case, args.op, comm)(warmup, iters)
    elif name == "mpi4py" and args.device == "cuda":  # staged by hand
        call = collectives.staged_by_hand(args.collective, args.dtype, count, args.op, comm,
                                          args.device)
        t = _time(comm, call, iters, warmup, args.device)
    elif name == "mpi4py":
        case = collectives.numpy_case(args.collective, args.dtype, count, comm)
        t = _time(comm, collectives.mpi4py_call(case, args.op, comm), iters, warmup)
    else:
        case = collectives.Case(args.collective, "torch", args.dtype, count, comm,
                                args.device)
        t = _time(comm, collectives.torch_call(case, args.op, gloo[name]), iters, warmup,
                  args.device)
    return comm.allreduce(t) / comm.Get_size()
