"""Every torch.distributed operation on the fastreduce backend, checked against a reference
computed here from every rank's inputs (each rank can make every rank's input) and against
gloo's answer in the same job wherever gloo implements the operation. Sync and async forms,
the world and subgroups (ranks outside a group call nothing), bad input."""

import faulthandler
import os

import torch
import torch.distributed as dist
from common import Failures

import fastreduce
import fastreduce.distributed as frd

assert "MASTER_ADDR" not in os.environ and "RANK" not in os.environ, "test must run bare"
f = Failures()
me = fastreduce.default_comm().Get_rank()
nranks = fastreduce.default_comm().Get_size()
# a rank or world size that is not MPI's is refused before anything is made
f.expect(ValueError, ["rank=", "MPI says", "leave rank out"],
         lambda: dist.init_process_group("fastreduce", rank=me + 1, world_size=nranks + 1))
f.check(not dist.is_initialized(), "a refused init_process_group left a group behind")
dist.init_process_group("fastreduce")  # rank, size and rendezvous from MPI
rank, size = dist.get_rank(), dist.get_world_size()
faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, before the timeout
f.check(rank == fastreduce.default_comm().Get_rank(), "torch rank is not the MPI rank")
f.check(size == fastreduce.default_comm().Get_size(), "world size is not MPI's")
f.check(dist.get_backend() == "fastreduce", f"backend {dist.get_backend()}")
gloo = dist.new_group(backend="gloo")  # same ranks, through the store of MPI's rendezvous

Op = dist.ReduceOp
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
OPS = {Op.SUM: FLOATS + INTS, Op.PRODUCT: FLOATS + INTS, Op.MIN: FLOATS + INTS,
       Op.MAX: FLOATS + INTS, Op.AVG: FLOATS, Op.BAND: INTS, Op.BOR: INTS, Op.BXOR: INTS}


def make(r: int, shape, dtype, salt: int = 0):
    """Rank r's input: small integer values (exact in every dtype, products included)."""
    g = torch.Generator().manual_seed(1000 * r + salt)
    if dtype.is_floating_point:
        return torch.randint(-3, 4, shape, generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, shape, generator=g).to(dtype)


def reference(values, op, dtype):
    stack = torch.stack([v.to(torch.float64) if dtype.is_floating_point else v.to(torch.int64)
                         for v in values])
    if op == Op.SUM:
        out = stack.sum(0)
    elif op == Op.AVG:
        out = stack.mean(0)
    elif op == Op.PRODUCT:
        out = stack.prod(0)
    elif op == Op.MIN:
        out = stack.min(0).values
    elif op == Op.MAX:
        out = stack.max(0).values
    else:
        fn = {Op.BAND: torch.bitwise_and, Op.BOR: torch.bitwise_or, Op.BXOR: torch.bitwise_xor}[op]
        out = stack[0]
        for v in stack[1:]:
            out = fn(out, v)
    return out.to(dtype)


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def with_gloo(fn, *args, **kw):
    """fn on the gloo group, or None where gloo does not implement it."""
    try:
        return fn(*args, group=gloo, **kw)
    except (RuntimeError, ValueError, NotImplementedError):
        return None


def finish(work, async_op):
    if async_op:
        f.check(isinstance(work, frd.Work), f"async_op returned {type(work)}")
        fut = work.get_future()
        work.wait()
        f.check(fut.done(), "future not done after wait()")


def check_allreduce(shape, async_op, group=None, members=None):
    members = members or list(range(size))
    for op, dtypes in OPS.items():
        for dtype in dtypes:
            if rank not in members:
                continue
            x = make(rank, shape, dtype, salt=int(op))
            want = reference([make(r, shape, dtype, salt=int(op)) for r in members], op, dtype)
            t = x.clone()
            finish(dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op)
            if op == Op.AVG and dtype in (torch.float16, torch.bfloat16):
                ok = torch.allclose(t.double(), want.double(), rtol=1e-2)
            else:
                ok = same(t, want)
            f.check(ok, f"all_reduce {op} {dtype} {shape} async={async_op} group={members}: "
                        f"{t.flatten()[:4]} want {want.flatten()[:4]}")
            if group is None:
                g = x.clone()
                if with_gloo(dist.all_reduce, g, op=op) is not None and op != Op.AVG:
                    f.check(same(t, g), f"all_reduce {op} {dtype}: differs from gloo")


def check_premul_sum():
    make_premul = getattr(dist, "_make_nccl_premul_sum", None)
    if make_premul is None:
        return
    x = make(rank, (5,), torch.float64)
    t = x.clone()
    dist.all_reduce(t, op=make_premul(0.5))
    want = reference([make(r, (5,), torch.float64) * 0.5 for r in range(size)], Op.SUM,
                     torch.float64)
    f.check(same(t, want), f"PREMUL_SUM: {t} want {want}")


def check_movement(shape, dtype, async_op):
    n = shape[0]
    root = size - 1
    # broadcast
    t = make(rank, shape, dtype)
    finish(dist.broadcast(t, src=root, async_op=async_op), async_op)
    f.check(same(t, make(root, shape, dtype)), f"broadcast {dtype} {shape}")
    # reduce (SUM and MAX)
    for op in (Op.SUM, Op.MAX):
        t = make(rank, shape, dtype, 1)
        finish(dist.reduce(t, dst=0, op=op, async_op=async_op), async_op)
        if rank == 0:
            want = reference([make(r, shape, dtype, 1) for r in range(size)], op, dtype)
            f.check(same(t, want), f"reduce {op} {dtype} {shape}")
    # all_gather (list) and all_gather_into_tensor
    outs = [torch.empty(shape, dtype=dtype) for _ in range(size)]
    finish(dist.all_gather(outs, make(rank, shape, dtype, 2), async_op=async_op), async_op)
    f.check(all(same(o, make(r, shape, dtype, 2)) for r, o in enumerate(outs)),
            f"all_gather {dtype} {shape}")
    flat = torch.empty((size * n,) + tuple(shape[1:]), dtype=dtype)
    finish(dist.all_gather_into_tensor(flat, make(rank, shape, dtype, 3), async_op=async_op),
           async_op)
    want = torch.cat([make(r, shape, dtype, 3) for r in range(size)])
    f.check(same(flat, want), f"all_gather_into_tensor {dtype} {shape}")
    g = torch.empty_like(flat)
    if with_gloo(dist.all_gather_into_tensor, g, make(rank, shape, dtype, 3)) is not None:
        f.check(same(flat, g), f"all_gather_into_tensor {dtype}: differs from gloo")
    # in place: the input is this rank's slot of the output
    flat = torch.zeros((size * n,) + tuple(shape[1:]), dtype=dtype)
    flat[rank * n:(rank + 1) * n] = make(rank, shape, dtype, 3)
    dist.all_gather_into_tensor(flat, flat[rank * n:(rank + 1) * n])
    f.check(same(flat, want), f"all_gather_into_tensor in place {dtype}")
    # reduce_scatter_tensor and reduce_scatter (list)
    big = make(rank, (size * n,) + tuple(shape[1:]), dtype, 4)
    out = torch.empty(shape, dtype=dtype)
    finish(dist.reduce_scatter_tensor(out, big, async_op=async_op), async_op)
    total = reference([make(r, (size * n,) + tuple(shape[1:]), dtype, 4) for r in range(size)],
                      Op.SUM, dtype)
    f.check(same(out, total[rank * n:(rank + 1) * n]), f"reduce_scatter_tensor {dtype} {shape}")
    g = torch.empty_like(out)
    if with_gloo(dist.reduce_scatter_tensor, g, big) is not None:
        f.check(same(out, g), f"reduce_scatter_tensor {dtype}: differs from gloo")
    out = torch.empty(shape, dtype=dtype)
    finish(dist.reduce_scatter(out, [c.clone() for c in big.chunk(size)], async_op=async_op),
           async_op)
    f.check(same(out, total[rank * n:(rank + 1) * n]), f"reduce_scatter {dtype} {shape}")
    # gather and scatter
    x = make(rank, shape, dtype, 5)
    gl = [torch.empty(shape, dtype=dtype) for _ in range(size)] if rank == root else None
    finish(dist.gather(x, gl, dst=root, async_op=async_op), async_op)
    if rank == root:
        f.check(all(same(o, make(r, shape, dtype, 5)) for r, o in enumerate(gl)),
                f"gather {dtype}")
    out = torch.empty(shape, dtype=dtype)
    sl = [make(100 + r, shape, dtype, 6) for r in range(size)] if rank == root else None
    finish(dist.scatter(out, sl, src=root, async_op=async_op), async_op)
    f.check(same(out, make(100 + rank, shape, dtype, 6)), f"scatter {dtype}")
    # all_to_all_single: equal splits, and uneven splits (rank r sends r+1+j rows to j)
    x = make(rank, (size * n,) + tuple(shape[1:]), dtype, 7)
    out = torch.empty_like(x)
    finish(dist.all_to_all_single(out, x, async_op=async_op), async_op)
    want = torch.cat([make(r, (size * n,) + tuple(shape[1:]), dtype, 7)[rank * n:(rank + 1) * n]
                      for r in range(size)])
    f.check(same(out, want), f"all_to_all_single {dtype}")
    send = [rank + 1 + j for j in range(size)]
    recv = [r + 1 + rank for r in range(size)]
    x = make(rank, (sum(send),) + tuple(shape[1:]), dtype, 8)
    out = torch.empty((sum(recv),) + tuple(shape[1:]), dtype=dtype)
    finish(dist.all_to_all_single(out, x, recv, send, async_op=async_op), async_op)
    parts = []
    for r in range(size):
        xr = make(r, (sum(r + 1 + j for j in range(size)),) + tuple(shape[1:]), dtype, 8)
        start = sum(r + 1 + j for j in range(rank))
        parts.append(xr[start:start + r + 1 + rank])
    f.check(same(out, torch.cat(parts)), f"all_to_all_single uneven {dtype}")
    # all_to_all (lists)
    ins = [make(rank * size + j, shape, dtype, 9) for j in range(size)]
    outs = [torch.empty(shape, dtype=dtype) for _ in range(size)]
    finish(dist.all_to_all(outs, ins, async_op=async_op), async_op)
    f.check(all(same(o, make(r * size + rank, shape, dtype, 9)) for r, o in enumerate(outs)),
            f"all_to_all {dtype}")


def check_coalesced():
    ts = [make(rank, (3,), torch.float64, 10), make(rank, (2, 2), torch.float32, 11)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for t, salt, shape in zip(ts, (10, 11), ((3,), (2, 2)), strict=True):
        want = reference([make(r, shape, t.dtype, salt) for r in range(size)], Op.SUM, t.dtype)
        f.check(same(t, want), f"coalesced all_reduce {t.dtype}")
    outs = [torch.empty(size * 2), torch.empty(size * 3)]
    ins = [make(rank, (2,), torch.float32, 12), make(rank, (3,), torch.float32, 13)]
    with dist._coalescing_manager():
        for o, x in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(o, x)
    for o, x, salt in zip(outs, ins, (12, 13), strict=True):
        want = torch.cat([make(r, x.shape, torch.float32, salt) for r in range(size)])
        f.check(same(o, want), "coalesced all_gather_into_tensor")


def check_p2p():
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    x = make(rank, (6,), torch.float32)
    got = torch.empty(6)
    reqs = [dist.isend(x, dst=right, tag=3), dist.irecv(got, src=left, tag=3)]
    for req in reqs:
        req.wait()
    f.check(same(got, make(left, (6,), torch.float32)), "isend/irecv ring")
    ops = [dist.P2POp(dist.isend, make(rank, (4,), torch.int64), right),
           dist.P2POp(dist.irecv, got4 := torch.empty(4, dtype=torch.int64), left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    f.check(same(got4, make(left, (4,), torch.int64)), "batch_isend_irecv")
    if rank == 0:
        sources = set()
        for _ in range(size - 1):
            t = torch.empty(2, dtype=torch.int64)
            src = dist.recv(t)  # any source
            sources.add(src)
            f.check(same(t, torch.tensor([src, src * 2])), f"recv from any source {src}: {t}")
        f.check(sources == set(range(1, size)), f"recv_anysource sources {sources}")
    else:
        dist.send(torch.tensor([rank, rank * 2]), dst=0)
    # a receive from any source is pending once posted: every rank posts one, then sends a
    # message large enough to need the receiver (rendezvous), then waits
    big = torch.full((1 << 18,), float(rank))
    got_big = torch.empty(1 << 18)
    pending = dist.irecv(got_big, tag=7)
    dist.send(big, dst=right, tag=7)
    pending.wait()
    f.check(torch.equal(got_big, torch.full((1 << 18,), float(left))),
            "irecv from any source posted before a large send")
    # the future of a point-to-point request completes without wait()
    if rank == 0:
        t = torch.empty(1)
        fut = dist.irecv(t, src=1, tag=5).get_future()
        fut.wait()
        f.check(t.item() == 42.0, f"irecv future value {t}")
    elif rank == 1:
        dist.send(torch.tensor([42.0]), dst=0, tag=5)


def check_objects():
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    f.check(objs == [{"rank": r, "s": "x" * r} for r in range(size)], f"all_gather_object {objs}")
    lst = [rank, "a"] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    f.check(lst == [0, "a"], f"broadcast_object_list {lst}")
    gathered = [None] * size if rank == 0 else None
    dist.gather_object(("g", rank), gathered, dst=0)
    if rank == 0:
        f.check(gathered == [("g", r) for r in range(size)], f"gather_object {gathered}")
    out = [None]
    dist.scatter_object_list(out, [("s", r) for r in range(size)] if rank == 0 else None, src=0)
    f.check(out == [("s", rank)], f"scatter_object_list {out}")


def check_subgroups():
    members = list(range(0, size, 2))  # every other rank; the others call nothing but new_group
    group = dist.new_group(members)
    if rank in members:
        f.check(dist.get_rank(group) == members.index(rank), "group rank")
        f.check(dist.get_world_size(group) == len(members), "group size")
        check_allreduce((3,), False, group, members)
        check_allreduce((3,), True, group, members)
        t = make(rank, (4,), torch.int32)
        dist.broadcast(t, src=members[-1], group=group)
        f.check(same(t, make(members[-1], (4,), torch.int32)), "subgroup broadcast")
        outs = [torch.empty(2) for _ in members]
        dist.all_gather(outs, make(rank, (2,), torch.float32), group=group)
        f.check(all(same(o, make(r, (2,), torch.float32)) for r, o in zip(members, outs,
                                                                         strict=True)),
                "subgroup all_gather")
        dist.barrier(group=group)
    # torch sorts a group's ranks: group rank = place in the sorted list
    rev = dist.new_group(list(reversed(range(size))))
    f.check(dist.get_rank(rev) == rank, "group rank of a reversed list")
    t = torch.tensor([float(rank)])
    dist.broadcast(t, group_src=size - 1, group=rev)
    f.check(t.item() == size - 1, f"reversed group broadcast {t}")
    # groups made for every rank at once, and device meshes (both through new_group)
    pairs = [list(range(i, min(i + 2, size))) for i in range(0, size, 2)]
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    pair = pairs[rank // 2]
    f.check(t.item() == sum(pair), f"new_subgroups_by_enumeration all_reduce {t} for {pair}")
    if size % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("dp", "tp"))
        for dim in ("dp", "tp"):
            group = mesh.get_group(dim)
            f.check(isinstance(group, frd.ProcessGroupFastreduce), f"mesh {dim} group {group}")
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            peers = dist.get_process_group_ranks(group)
            f.check(t.item() == sum(peers), f"mesh {dim} all_reduce {t} over {peers}")
    # dist.split_group needs a C++ backend that splits (and an accelerator): not this one
    # a fastreduce partition's cached sub-communicator as a torch group
    if size >= 2 and size % 2 == 0:
        cart = fastreduce.Partition().create_cartesian_topology_partition([2, size // 2])
        sub = cart.create_cartesian_subtopology_partition([True, False])  # along axis 0
        pg = sub.process_group()
        f.check(pg is sub.process_group(), "process_group() is not cached")
        f.check(isinstance(pg, frd.ProcessGroupFastreduce) and pg.comm is sub.comm,
                "the partition's group does not run on its communicator")
        t = make(rank, (3,), torch.float64)
        dist.all_reduce(t, group=pg)
        peers = [r for r in range(size) if r % (size // 2) == rank % (size // 2)]
        f.check(same(t, reference([make(r, (3,), torch.float64) for r in peers], Op.SUM,
                                  torch.float64)), f"partition group all_reduce {peers}")


def check_bad_input():
    x = make(rank, (4,), torch.float32)
    f.expect(BufferError, ["not contiguous", "contiguous()"],
             lambda: dist.all_reduce(torch.ones(4, 4).t()))
    f.expect(ValueError, ["bool", "sum"], lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool),
                                                          op=Op.SUM), )
    f.expect(ValueError, ["band", "float32"], lambda: dist.all_reduce(x, op=Op.BAND), x)
    f.expect(ValueError, ["output", "elements"],
             lambda: dist.all_gather_into_tensor(torch.empty(size * 4 + 1), x), x)
    f.expect(ValueError, ["reduce_scatter_tensor", "input"],
             lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.empty(size * 3 + 1)))
    f.expect(ValueError, ["input_split_sizes"],
             lambda: dist.all_to_all_single(torch.empty(size), torch.empty(size),
                                            [1] * size, [2] * size), x)
    f.expect(frd.BackendError, ["layout", "dense"],
             lambda: dist.all_reduce(torch.eye(3).to_sparse()))
    f.expect(frd.BackendError, ["meta", "cpu and cuda"],
             lambda: dist.broadcast(torch.empty(3, device="meta"), src=0))
    # a failed call leaves the group usable
    t = make(rank, (2,), torch.int64)
    dist.all_reduce(t)
    f.check(same(t, reference([make(r, (2,), torch.int64) for r in range(size)], Op.SUM,
                              torch.int64)), "all_reduce after rejected calls")


for async_op in (False, True):
    f.run(f"allreduce async={async_op}", check_allreduce, (7,), async_op)
    f.run(f"allreduce large async={async_op}", check_allreduce, (40000,), async_op)
f.run("premul_sum", check_premul_sum)
for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
    for async_op in (False, True):
        f.run(f"movement {dtype} async={async_op}", check_movement, (3,), dtype, async_op)
f.run("movement large", check_movement, (5, 20000), torch.float32, True)
f.run("movement empty", check_movement, (0,), torch.float32, False)
f.run("coalesced", check_coalesced)
f.run("p2p", check_p2p)
f.run("objects", check_objects)
f.run("subgroups", check_subgroups)
f.run("bad input", check_bad_input)
dist.barrier()
dist.destroy_process_group()
f.finish()
