"""Every torch.distributed operation on the fastreduce backend, checked against a reference
computed here from every rank's inputs (each rank can make every rank's input) and against
gloo's answer in the same job wherever gloo implements the operation. Sync and async forms,
the world and subgroups (ranks outside a group call nothing), bad input.

Every case runs on 1 to 4 ranks, and on 3 ranks twice more: with the progress engine off
(engine.set_enabled(False), as FASTREDUCE_ENGINE=0: non-blocking operations run at once,
same answers) and with every non-blocking operation, however small, on the engine
(engine.set_host(True), as FASTREDUCE_ENGINE_HOST_BYTES=0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import fastreduce
import fastreduce.distributed as frd
from fastreduce.torch.versions import _release, _work_needs_cpp_wrapper

# Python above the core: every rank count in MPICH's sessions (torch 2.13), and on Open MPI
# in the minimum versions' pass (torch 2.4) and the newest torch's (2.15), 2 ranks each
# (tools/test.sh).
pytestmark = [pytest.mark.minimum_versions, pytest.mark.one_mpi]


@pytest.fixture(scope="module", autouse=True, params=[
    pytest.param("default", id="default",
                 marks=[pytest.mark.mpi(ranks=(1, 2, 3, 4)), pytest.mark.across_nodes]),
    pytest.param("engine-off", id="engine-off", marks=pytest.mark.mpi(ranks=3)),
    pytest.param("engine-every-size", id="engine-every-size", marks=pytest.mark.mpi(ranks=3)),
])
def engine(request):
    """The progress engine as the environment says (default), off (non-blocking calls on
    MPI's non-blocking collectives), or running every non-blocking host operation."""
    from fastreduce.backend import engine

    if request.param == "engine-off":
        engine.set_enabled(False)
    elif request.param == "engine-every-size":
        engine.set_host(True)
    yield request.param
    engine.set_enabled(None)
    engine.set_host(None)


@dataclass
class World:
    rank: int
    size: int
    gloo: dist.ProcessGroup  # the same ranks on gloo, for its answers


@pytest.fixture(scope="module")
def world(engine) -> World:
    """The default group on fastreduce (rank, size and rendezvous from MPI), and gloo's;
    destroyed at the module's end."""
    assert "MASTER_ADDR" not in os.environ, "test must run bare (no torchrun rendezvous)"
    dist.init_process_group("fastreduce")
    yield World(dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo"))
    dist.barrier()
    dist.destroy_process_group()


Op = dist.ReduceOp
FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
OPS = {Op.SUM: FLOATS + INTS, Op.PRODUCT: FLOATS + INTS, Op.MIN: FLOATS + INTS,
       Op.MAX: FLOATS + INTS, Op.AVG: FLOATS, Op.BAND: INTS, Op.BOR: INTS, Op.BXOR: INTS}


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def with_gloo(w: World, fn, *args, **kw) -> bool:
    """fn on the gloo group: whether gloo implements it (a blocking call returns None)."""
    try:
        fn(*args, group=w.gloo, **kw)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def finish(f, work, async_op):
    if async_op:
        # below 2.13 torch waits on a work through C++: the backend returns a C++ work there
        wanted = dist.Work if _work_needs_cpp_wrapper(_release(torch.__version__)) else frd.Work
        f.check(isinstance(work, wanted), f"async_op returned {type(work)}")
        fut = work.get_future()
        work.wait()
        f.check(fut.done(), "future not done after wait()")


ASYNC = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def test_a_rank_or_size_not_mpis_is_refused(checks):
    """A rank or world size that is not MPI's is refused before anything is made."""
    me = fastreduce.default_comm().Get_rank()
    nranks = fastreduce.default_comm().Get_size()
    checks.expect(ValueError, ["rank=", "MPI says", "leave rank out"],
                  lambda: dist.init_process_group("fastreduce", rank=me + 1,
                                                  world_size=nranks + 1))
    checks.check(not dist.is_initialized(), "a refused init_process_group left a group behind")


def test_rank_and_size_are_mpis(world, checks):
    """init_process_group with no arguments: rank, size and rendezvous from MPI."""
    checks.check(world.rank == fastreduce.default_comm().Get_rank(),
                 "torch rank is not the MPI rank")
    checks.check(world.size == fastreduce.default_comm().Get_size(), "world size is not MPI's")
    checks.check(dist.get_backend() == "fastreduce", f"backend {dist.get_backend()}")


# --- all_reduce: every op and dtype, against the reference and gloo -----------------------
def allreduce_case(f, w: World, op, dtype, shape, async_op, group=None, members=None):
    """One op and dtype: all_reduce on `group` (the world: also against gloo)."""
    members = members or list(range(w.size))
    rank = w.rank
    x = make(rank, shape, dtype, salt=int(op))
    want = reference([make(r, shape, dtype, salt=int(op)) for r in members], op, dtype)
    t = x.clone()
    finish(f, dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op)
    if op == Op.AVG and dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(t.double(), want.double(), rtol=1e-2)
    else:
        ok = same(t, want)
    f.check(ok, f"all_reduce {op} {dtype} {shape} async={async_op} group={members}: "
                f"{t.flatten()[:4]} want {want.flatten()[:4]}")
    if group is None:
        g = x.clone()
        if with_gloo(w, dist.all_reduce, g, op=op) and op != Op.AVG:
            f.check(same(t, g), f"all_reduce {op} {dtype}: differs from gloo")


@pytest.mark.parametrize("async_op", ASYNC)
@pytest.mark.parametrize("shape", [pytest.param((7,), id="small"),
                                   pytest.param((40000,), id="large")])
@pytest.mark.parametrize(("op", "dtype"), [
    pytest.param(op, dtype, id=f"{op.name.lower()}-{name(dtype)}")
    for op, dtypes in OPS.items() for dtype in dtypes])
def test_all_reduce(world, checks, op, dtype, shape, async_op):
    checks.run(f"allreduce {op} {dtype} {shape} async={async_op}", allreduce_case, checks,
               world, op, dtype, shape, async_op)


def test_premul_sum(world, checks):
    """PREMUL_SUM (what FSDP asks for): each input scaled, then summed."""
    def body():
        make_premul = getattr(dist, "_make_nccl_premul_sum", None)
        if make_premul is None:
            return
        x = make(world.rank, (5,), torch.float64)
        t = x.clone()
        if not hasattr(make_premul(0.5), "factor"):  # torch 2.4: refused, by name, unchanged
            with pytest.raises(frd.BackendError, match="PREMUL_SUM needs torch 2.13"):
                dist.all_reduce(t, op=make_premul(0.5))
            checks.check(torch.equal(t, x), "PREMUL_SUM refused but the tensor changed")
            return
        dist.all_reduce(t, op=make_premul(0.5))
        want = reference([make(r, (5,), torch.float64) * 0.5 for r in range(world.size)],
                         Op.SUM, torch.float64)
        checks.check(same(t, want), f"PREMUL_SUM: {t} want {want}")

    checks.run("premul_sum", body)


# --- data movement: every operation, 4 dtypes sync and async, one large, one empty --------
MOVEMENT = [pytest.param((3,), dtype, async_op, id=f"{name(dtype)}-{mode}")
            for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8)
            for async_op, mode in ((False, "sync"), (True, "async"))]
MOVEMENT += [pytest.param((5, 20000), torch.float32, True, id="large-float32-async"),
             pytest.param((0,), torch.float32, False, id="empty-float32-sync")]
movement = pytest.mark.parametrize(("shape", "dtype", "async_op"), MOVEMENT)


def rows(shape, k: int) -> tuple:
    """`shape` with k times its first dimension."""
    return (k * shape[0],) + tuple(shape[1:])


@movement
def test_broadcast(world, checks, shape, dtype, async_op):
    def body():
        root = world.size - 1
        t = make(world.rank, shape, dtype)
        finish(checks, dist.broadcast(t, src=root, async_op=async_op), async_op)
        checks.check(same(t, make(root, shape, dtype)), f"broadcast {dtype} {shape}")

    checks.run(f"movement broadcast {dtype} {shape} async={async_op}", body)


@pytest.mark.parametrize("op", [Op.SUM, Op.MAX], ids=["sum", "max"])
@movement
def test_reduce(world, checks, shape, dtype, async_op, op):
    def body():
        t = make(world.rank, shape, dtype, 1)
        finish(checks, dist.reduce(t, dst=0, op=op, async_op=async_op), async_op)
        if world.rank == 0:
            want = reference([make(r, shape, dtype, 1) for r in range(world.size)], op, dtype)
            checks.check(same(t, want), f"reduce {op} {dtype} {shape}")

    checks.run(f"movement reduce {op} {dtype} {shape} async={async_op}", body)


@movement
def test_all_gather(world, checks, shape, dtype, async_op):
    def body():
        outs = [torch.empty(shape, dtype=dtype) for _ in range(world.size)]
        finish(checks, dist.all_gather(outs, make(world.rank, shape, dtype, 2),
                                       async_op=async_op), async_op)
        checks.check(all(same(o, make(r, shape, dtype, 2)) for r, o in enumerate(outs)),
                     f"all_gather {dtype} {shape}")

    checks.run(f"movement all_gather {dtype} {shape} async={async_op}", body)


@movement
def test_all_gather_into_tensor(world, checks, shape, dtype, async_op):
    """Against the reference and gloo, then in place (the input is this rank's slot of the
    output)."""
    def body():
        rank, size, n = world.rank, world.size, shape[0]
        flat = torch.empty(rows(shape, size), dtype=dtype)
        finish(checks, dist.all_gather_into_tensor(flat, make(rank, shape, dtype, 3),
                                                   async_op=async_op), async_op)
        want = torch.cat([make(r, shape, dtype, 3) for r in range(size)])
        checks.check(same(flat, want), f"all_gather_into_tensor {dtype} {shape}")
        g = torch.empty_like(flat)
        if with_gloo(world, dist.all_gather_into_tensor, g, make(rank, shape, dtype, 3)):
            checks.check(same(flat, g), f"all_gather_into_tensor {dtype}: differs from gloo")
        flat = torch.zeros(rows(shape, size), dtype=dtype)
        flat[rank * n:(rank + 1) * n] = make(rank, shape, dtype, 3)
        dist.all_gather_into_tensor(flat, flat[rank * n:(rank + 1) * n])
        checks.check(same(flat, want), f"all_gather_into_tensor in place {dtype}")

    checks.run(f"movement all_gather_into_tensor {dtype} {shape} async={async_op}", body)


@movement
def test_reduce_scatter_tensor(world, checks, shape, dtype, async_op):
    def body():
        rank, size, n = world.rank, world.size, shape[0]
        big = make(rank, rows(shape, size), dtype, 4)
        out = torch.empty(shape, dtype=dtype)
        finish(checks, dist.reduce_scatter_tensor(out, big, async_op=async_op), async_op)
        total = reference([make(r, rows(shape, size), dtype, 4) for r in range(size)],
                          Op.SUM, dtype)
        checks.check(same(out, total[rank * n:(rank + 1) * n]),
                     f"reduce_scatter_tensor {dtype} {shape}")
        g = torch.empty_like(out)
        if with_gloo(world, dist.reduce_scatter_tensor, g, big):
            checks.check(same(out, g), f"reduce_scatter_tensor {dtype}: differs from gloo")

    checks.run(f"movement reduce_scatter_tensor {dtype} {shape} async={async_op}", body)


@movement
def test_reduce_scatter(world, checks, shape, dtype, async_op):
    """The list form: one input tensor per rank."""
    def body():
        rank, size, n = world.rank, world.size, shape[0]
        big = make(rank, rows(shape, size), dtype, 4)
        total = reference([make(r, rows(shape, size), dtype, 4) for r in range(size)],
                          Op.SUM, dtype)
        out = torch.empty(shape, dtype=dtype)
        finish(checks, dist.reduce_scatter(out, [c.clone() for c in big.chunk(size)],
                                           async_op=async_op), async_op)
        checks.check(same(out, total[rank * n:(rank + 1) * n]),
                     f"reduce_scatter {dtype} {shape}")

    checks.run(f"movement reduce_scatter {dtype} {shape} async={async_op}", body)


@movement
def test_gather(world, checks, shape, dtype, async_op):
    def body():
        rank, size, root = world.rank, world.size, world.size - 1
        x = make(rank, shape, dtype, 5)
        gl = [torch.empty(shape, dtype=dtype) for _ in range(size)] if rank == root else None
        finish(checks, dist.gather(x, gl, dst=root, async_op=async_op), async_op)
        if rank == root:
            checks.check(all(same(o, make(r, shape, dtype, 5)) for r, o in enumerate(gl)),
                         f"gather {dtype}")

    checks.run(f"movement gather {dtype} {shape} async={async_op}", body)


@movement
def test_scatter(world, checks, shape, dtype, async_op):
    def body():
        rank, size, root = world.rank, world.size, world.size - 1
        out = torch.empty(shape, dtype=dtype)
        sl = [make(100 + r, shape, dtype, 6) for r in range(size)] if rank == root else None
        finish(checks, dist.scatter(out, sl, src=root, async_op=async_op), async_op)
        checks.check(same(out, make(100 + rank, shape, dtype, 6)), f"scatter {dtype}")

    checks.run(f"movement scatter {dtype} {shape} async={async_op}", body)


@movement
def test_all_to_all_single(world, checks, shape, dtype, async_op):
    """Equal splits."""
    def body():
        rank, size, n = world.rank, world.size, shape[0]
        x = make(rank, rows(shape, size), dtype, 7)
        out = torch.empty_like(x)
        finish(checks, dist.all_to_all_single(out, x, async_op=async_op), async_op)
        want = torch.cat([make(r, rows(shape, size), dtype, 7)[rank * n:(rank + 1) * n]
                          for r in range(size)])
        checks.check(same(out, want), f"all_to_all_single {dtype}")

    checks.run(f"movement all_to_all_single {dtype} {shape} async={async_op}", body)


@movement
def test_all_to_all_single_uneven(world, checks, shape, dtype, async_op):
    """Uneven splits: rank r sends r+1+j rows to rank j."""
    def body():
        rank, size = world.rank, world.size
        tail = tuple(shape[1:])
        send = [rank + 1 + j for j in range(size)]
        recv = [r + 1 + rank for r in range(size)]
        x = make(rank, (sum(send),) + tail, dtype, 8)
        out = torch.empty((sum(recv),) + tail, dtype=dtype)
        finish(checks, dist.all_to_all_single(out, x, recv, send, async_op=async_op), async_op)
        parts = []
        for r in range(size):
            xr = make(r, (sum(r + 1 + j for j in range(size)),) + tail, dtype, 8)
            start = sum(r + 1 + j for j in range(rank))
            parts.append(xr[start:start + r + 1 + rank])
        checks.check(same(out, torch.cat(parts)), f"all_to_all_single uneven {dtype}")

    checks.run(f"movement all_to_all_single uneven {dtype} {shape} async={async_op}", body)


@pytest.mark.parametrize("async_op", ASYNC)
def test_all_to_all_single_uneven_across_the_engine_threshold(world, checks, async_op):
    """Uneven splits whose byte counts fall on both sides of the engine's threshold
    (FASTREDUCE_ENGINE_HOST_BYTES, 64 KiB) on different ranks: every rank runs the call the
    same way (it hung when one rank took the engine and another not)."""
    def body():
        rank, size = world.rank, world.size
        rows = 40000 if rank == 0 else 1  # rank 0 sends 160 KB to each rank, the others 4 B
        send = [rows] * size
        recv = [40000 if r == 0 else 1 for r in range(size)]
        x = torch.full((rows * size,), float(rank))
        out = torch.empty(sum(recv))
        finish(checks, dist.all_to_all_single(out, x, recv, send, async_op=async_op),
               async_op)
        want = torch.cat([torch.full((recv[r],), float(r)) for r in range(size)])
        checks.check(same(out, want), "uneven all_to_all_single across the threshold")

    checks.run(f"all_to_all_single across the engine threshold async={async_op}", body)


@movement
def test_all_to_all(world, checks, shape, dtype, async_op):
    """The list form."""
    def body():
        rank, size = world.rank, world.size
        ins = [make(rank * size + j, shape, dtype, 9) for j in range(size)]
        outs = [torch.empty(shape, dtype=dtype) for _ in range(size)]
        finish(checks, dist.all_to_all(outs, ins, async_op=async_op), async_op)
        checks.check(all(same(o, make(r * size + rank, shape, dtype, 9))
                         for r, o in enumerate(outs)), f"all_to_all {dtype}")

    checks.run(f"movement all_to_all {dtype} {shape} async={async_op}", body)


# --- coalesced ----------------------------------------------------------------------------
def test_sparse_all_reduce(world, checks):
    """Sparse COO tensors summed as gloo sums them (duplicates added), every rank's entries
    in the result; a rank with no entries; refusals on every rank."""
    rank, size = world.rank, world.size

    def mine(r):
        if r == 1:  # no entries at all
            return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64),
                                           torch.zeros(0, 2), (size + 1, 2),
                                           check_invariants=True)
        return torch.sparse_coo_tensor(torch.tensor([[r, r + 1]]),
                                       torch.tensor([[r + 1.0, 1.0], [2.0, r * 3.0]]),
                                       (size + 1, 2), check_invariants=True)

    def body():
        t = mine(rank)
        dist.all_reduce(t)
        want = sum(mine(r).to_dense() for r in range(size))
        checks.check(t.is_sparse and torch.equal(t.to_dense(), want), f"sparse sum {t}")
        g = mine(rank)
        if with_gloo(world, dist.all_reduce, g):
            checks.check(torch.equal(g.to_dense(), t.to_dense()), "differs from gloo")
        with pytest.raises(frd.BackendError, match="sums only"):
            dist.all_reduce(mine(rank), op=dist.ReduceOp.MAX)
        if size > 1:
            odd = mine(rank) if rank else torch.sparse_coo_tensor(
                torch.tensor([[0]]), torch.tensor([[1.0, 1.0]]), (size + 2, 2),
                check_invariants=True)
            with pytest.raises(frd.BackendError, match="differ between ranks"):
                dist.all_reduce(odd)

    checks.run("sparse all_reduce", body)


def test_coalesced_all_reduce(world, checks):
    def body():
        rank, size = world.rank, world.size
        ts = [make(rank, (3,), torch.float64, 10), make(rank, (2, 2), torch.float32, 11)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t)
        cm.wait()
        for t, salt, shape in zip(ts, (10, 11), ((3,), (2, 2)), strict=True):
            want = reference([make(r, shape, t.dtype, salt) for r in range(size)], Op.SUM,
                             t.dtype)
            checks.check(same(t, want), f"coalesced all_reduce {t.dtype}")

    checks.run("coalesced all_reduce", body)


def test_coalesced_all_gather_into_tensor(world, checks):
    def body():
        rank, size = world.rank, world.size
        outs = [torch.empty(size * 2), torch.empty(size * 3)]
        ins = [make(rank, (2,), torch.float32, 12), make(rank, (3,), torch.float32, 13)]
        with dist._coalescing_manager():
            for o, x in zip(outs, ins, strict=True):
                dist.all_gather_into_tensor(o, x)
        for o, x, salt in zip(outs, ins, (12, 13), strict=True):
            want = torch.cat([make(r, x.shape, torch.float32, salt) for r in range(size)])
            checks.check(same(o, want), "coalesced all_gather_into_tensor")

    checks.run("coalesced all_gather_into_tensor", body)


def test_all_gather_coalesced_is_laid_out_as_gloos(world, checks):
    """output_tensor_lists[r][i] is rank r's input i, as torch documents and gloo does: with
    as many inputs as ranks (the layout read transposed gave wrong tensors silently there)
    and with three inputs of different shapes (refused as invalid before)."""
    def body():
        rank, size = world.rank, world.size
        for shapes in ([(2,)] * size, [(2,), (3, 2), (1,)]):
            ins = [make(rank, s, torch.float32, 30 + i) for i, s in enumerate(shapes)]
            outs = [[torch.full(s, -1.0) for s in shapes] for _ in range(size)]
            dist.all_gather_coalesced(outs, ins)
            want = [[make(r, s, torch.float32, 30 + i) for i, s in enumerate(shapes)]
                    for r in range(size)]
            checks.check(all(same(o, w) for os_, ws in zip(outs, want, strict=True)
                             for o, w in zip(os_, ws, strict=True)),
                         f"all_gather_coalesced {shapes}: not output[rank][input]")
            g = [[torch.full(s, -1.0) for s in shapes] for _ in range(size)]
            if with_gloo(world, dist.all_gather_coalesced, g, ins):
                checks.check(all(same(o, w) for os_, ws in zip(outs, g, strict=True)
                                 for o, w in zip(os_, ws, strict=True)),
                             f"all_gather_coalesced {shapes}: differs from gloo")
            else:
                checks.check(False, "gloo refused all_gather_coalesced")
        bad = [[torch.empty(2)] for _ in range(size + 1)]
        with pytest.raises(ValueError, match="one output list per rank"):
            dist.all_gather_coalesced(bad, [torch.zeros(2)])

    checks.run("all_gather_coalesced", body)


# --- the group as torch and torchrun scripts look at it -------------------------------------
def test_torchrun_environment(world, checks):
    """Under mpiexec the import set torchrun's variables from MPI (the node's ranks found
    here by mpi4py's own MPI_Comm_split_type)."""
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    want = {"RANK": world.rank, "WORLD_SIZE": world.size, "LOCAL_RANK": node.Get_rank(),
            "LOCAL_WORLD_SIZE": node.Get_size()}
    node.Free()
    got = {k: os.environ.get(k) for k in want}
    checks.check(got == {k: str(v) for k, v in want.items()}, f"torchrun variables {got}")


def test_backend_per_device(world, checks):
    """torch's look-ups by device: the default device (torch.distributed.checkpoint), the
    object collectives' device, a backend per device (batch_isend_irecv on torch 2.15)."""
    import warnings

    c10d = dist.distributed_c10d
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # _get_pg_default_device is deprecated
        checks.check(c10d._get_pg_default_device() == torch.device("cpu"),
                     "default device is not the host")
    if hasattr(c10d, "_device_capability"):  # not in torch 2.4
        devices = c10d._device_capability()
        checks.check(devices == (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]),
                     f"devices {devices}")
    if hasattr(c10d, "_get_object_coll_device"):  # not in torch 2.4
        checks.check(c10d._get_object_coll_device() == "cpu", "object collectives' device")
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    checks.check(backend.supports_coalescing is False, "coalescing claimed")
    checks.check(backend.getBackendName() == "fastreduce", f"backend {backend}")
    t = torch.ones(2)
    backend.allreduce([t], dist.AllreduceOptions()).wait()  # its operations are the group's
    checks.check(torch.equal(t, torch.full((2,), float(world.size))), f"sum {t}")
    with pytest.raises(RuntimeError, match="(?i)backend.* device type meta"):
        dist.group.WORLD._get_backend(torch.device("meta"))


def test_profiler_events(world, checks):
    """One event per operation, named as torch's backends name theirs, with the input
    shapes, asynchronous as theirs are (blocking operations too); an operation made of
    others (all_to_all of all_to_all_single) records one."""
    from torch.autograd import profiler

    t = make(world.rank, (4, 3), torch.float32)
    out = torch.empty(world.size * 4, 3)
    with profiler.profile(record_shapes=True) as prof:
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather_into_tensor(out, t)
        dist.all_to_all([torch.empty(1) for _ in range(world.size)],
                        [torch.zeros(1) for _ in range(world.size)])
        dist.all_reduce(t, async_op=True).wait()
        dist.barrier()
    events = {}
    for e in prof.function_events:
        if e.name.startswith("fastreduce:"):
            events.setdefault(e.name, []).append(e)
    counts = {name: len(es) for name, es in events.items()}
    checks.check(counts == {"fastreduce:all_reduce": 2, "fastreduce:broadcast": 1,
                            "fastreduce:all_gather_into_tensor": 1,
                            "fastreduce:all_to_all": 1, "fastreduce:barrier": 1},
                 f"events {counts}")
    shapes = [e.input_shapes for e in events.get("fastreduce:all_reduce", [])]
    checks.check(shapes == [[[4, 3]], [[4, 3]]], f"all_reduce shapes {shapes}")
    blocking = [name for name, es in events.items() for e in es if not e.is_async]
    checks.check(not blocking, f"events not asynchronous (torch's backends' are): {blocking}")


def test_profiler_event_of_background_work_ends_when_it_completes(world, checks):
    """An all-reduce run on the progress engine (256 KiB, async_op; where the engine is
    off, at once): its event is asynchronous and ends when the work completes, not when
    the profiler stops."""
    import time

    from torch.autograd import profiler

    from fastreduce.backend import engine

    t = torch.ones(1 << 16)
    dist.all_reduce(t, async_op=True).wait()  # the engine started before the profile
    with profiler.profile() as prof:
        start = time.perf_counter()
        if engine.state()[0]:  # held busy, so the work cannot finish before its event is
            engine.submit_call(lambda: time.sleep(0.2))  # handed on (a race on one rank)
        dist.all_reduce(t, async_op=True).wait()
        waited = time.perf_counter() - start
        time.sleep(0.5)
    events = [e for e in prof.function_events if e.name == "fastreduce:all_reduce"]
    checks.check(len(events) == 1, f"{len(events)} events")
    for e in events:
        lasted = e.time_range.elapsed_us() / 1e6
        checks.check(lasted < waited + 0.25, f"the event lasted {lasted:.3f} s, the work "
                                             f"{waited:.3f} s: it ended at the profile's end")
        checks.check(e.is_async, "not asynchronous (every operation's event is)")


def test_profile_read_at_once_after_wait_of_background_work(world, checks):
    """wait() returns only once the profiler event of work completed on the engine's thread
    has ended there: a profile stopped and read right after wait() sees every event, and
    nothing races with the end (before: a segmentation fault in some rounds)."""
    from torch.autograd import profiler

    t = torch.ones(1 << 16)
    dist.all_reduce(t, async_op=True).wait()  # the engine started before the profiles
    counts = []
    for _ in range(40):
        with profiler.profile() as prof:
            dist.all_reduce(t, async_op=True).wait()
        counts.append(sum(e.name == "fastreduce:all_reduce" for e in prof.function_events))
    checks.check(counts == [1] * 40, f"events per profile {counts}")


def raised_within(call, error) -> tuple[str | None, float]:
    """(the message of the `error` call() raised, or None; the seconds call() took)."""
    import time

    start = time.monotonic()
    try:
        call()
    except error as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


def test_barrier_times_out_on_every_waiting_rank(world, checks, ring):
    """The last rank comes late: every other rank's barrier raises at the group's timeout
    (1 s), naming the barrier; the late rank's arrival then completes their barrier."""
    import datetime

    from fastreduce.errors import BarrierTimeout

    group = dist.new_group(timeout=datetime.timedelta(seconds=1))
    late = world.rank == world.size - 1
    raised = None
    try:
        if not late:
            raised, waited = raised_within(lambda: dist.barrier(group=group), BarrierTimeout)
            checks.check(raised is not None and "barrier timed out after 1 s" in raised
                         and "the group's timeout" in raised, f"raised {raised!r}")
            checks.check(1.0 <= waited < 30, f"barrier ended after {waited:.2f} s")
    finally:
        fastreduce.default_comm().Barrier()  # the others are past their barrier
    if late:
        dist.barrier(group=group)  # matches their pending barrier
    elif raised is not None:
        group._abandoned[0].Wait()
    dist.destroy_process_group(group)


def test_wait_with_a_timeout_raises_and_the_work_completes_later(world, checks, ring):
    """A receive whose sender comes late: wait(timeout) raises WaitTimeout at the bound,
    the receive stays posted, and a later wait() gets the data."""
    import datetime

    from fastreduce.errors import WaitTimeout

    right, left = ring
    got = torch.zeros(4)
    work = dist.irecv(got, src=left)
    raised, waited = raised_within(lambda: work.wait(datetime.timedelta(seconds=0.3)),
                                   WaitTimeout)
    checks.check(raised is not None and "timed out after 0.3 s" in raised
                 and "still in flight" in raised, f"raised {raised!r}")
    checks.check(0.3 <= waited < 30, f"wait ended after {waited:.2f} s")
    checks.check(not work.is_completed(), "the receive completed with no sender")
    fastreduce.default_comm().Barrier()  # every rank is past its timed-out wait
    dist.send(torch.full((4,), float(world.rank)), dst=right)
    checks.check(work.wait(datetime.timedelta(seconds=60)), "wait() after the send")
    checks.check(torch.equal(got, torch.full((4,), float(left))), f"received {got}")


# --- point to point -----------------------------------------------------------------------
@pytest.fixture
def ring(world):
    """(right, left): this rank's neighbours; a point-to-point case needs 2 ranks."""
    if world.size == 1:
        pytest.skip("point-to-point needs 2 ranks or more")
    return (world.rank + 1) % world.size, (world.rank - 1) % world.size


def test_isend_irecv_ring(world, checks, ring):
    def body():
        right, left = ring
        x = make(world.rank, (6,), torch.float32)
        got = torch.empty(6)
        reqs = [dist.isend(x, dst=right, tag=3), dist.irecv(got, src=left, tag=3)]
        for req in reqs:
            req.wait()
        checks.check(same(got, make(left, (6,), torch.float32)), "isend/irecv ring")

    checks.run("p2p isend/irecv ring", body)


def test_profiler_events_of_point_to_point_work(world, checks, ring):
    """isend/irecv waited for on the caller's thread: one asynchronous event each, ended
    before wait() returns, the result intact."""
    from torch.autograd import profiler

    right, left = ring
    x = make(world.rank, (6,), torch.float32)
    got = torch.empty(6)
    with profiler.profile() as prof:
        reqs = [dist.isend(x, dst=right, tag=5), dist.irecv(got, src=left, tag=5)]
        for req in reqs:
            req.wait()
    events = [(e.name, e.is_async) for e in prof.function_events
              if e.name in ("fastreduce:send", "fastreduce:recv")]
    checks.check(sorted(events) == [("fastreduce:recv", True), ("fastreduce:send", True)],
                 f"events {events}")
    checks.check(same(got, make(left, (6,), torch.float32)), "isend/irecv under the profiler")


def test_batch_isend_irecv(world, checks, ring):
    def body():
        right, left = ring
        ops = [dist.P2POp(dist.isend, make(world.rank, (4,), torch.int64), right),
               dist.P2POp(dist.irecv, got4 := torch.empty(4, dtype=torch.int64), left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        checks.check(same(got4, make(left, (4,), torch.int64)), "batch_isend_irecv")

    checks.run("p2p batch_isend_irecv", body)


def test_recv_from_any_source(world, checks, ring):
    def body():
        rank, size = world.rank, world.size
        if rank == 0:
            sources = set()
            for _ in range(size - 1):
                t = torch.empty(2, dtype=torch.int64)
                src = dist.recv(t)  # any source
                sources.add(src)
                checks.check(same(t, torch.tensor([src, src * 2])),
                             f"recv from any source {src}: {t}")
            checks.check(sources == set(range(1, size)), f"recv_anysource sources {sources}")
        else:
            dist.send(torch.tensor([rank, rank * 2]), dst=0)

    checks.run("p2p recv from any source", body)


def test_irecv_from_any_source_before_a_large_send(world, checks, ring):
    """A receive from any source is pending once posted: every rank posts one, then sends a
    message large enough to need the receiver (rendezvous), then waits."""
    def body():
        right, left = ring
        big = torch.full((1 << 18,), float(world.rank))
        got_big = torch.empty(1 << 18)
        pending = dist.irecv(got_big, tag=7)
        dist.send(big, dst=right, tag=7)
        pending.wait()
        checks.check(torch.equal(got_big, torch.full((1 << 18,), float(left))),
                     "irecv from any source posted before a large send")

    checks.run("p2p irecv from any source before a large send", body)


def test_irecv_future_completes_without_wait(world, checks, ring):
    """The future of a point-to-point request completes without wait()."""
    def body():
        if world.rank == 0:
            t = torch.empty(1)
            fut = dist.irecv(t, src=1, tag=5).get_future()
            fut.wait()
            checks.check(t.item() == 42.0, f"irecv future value {t}")
        elif world.rank == 1:
            dist.send(torch.tensor([42.0]), dst=0, tag=5)

    checks.run("p2p irecv future", body)


# --- objects ------------------------------------------------------------------------------
def test_all_gather_object(world, checks):
    def body():
        objs = [None] * world.size
        dist.all_gather_object(objs, {"rank": world.rank, "s": "x" * world.rank})
        checks.check(objs == [{"rank": r, "s": "x" * r} for r in range(world.size)],
                     f"all_gather_object {objs}")

    checks.run("objects all_gather_object", body)


def test_broadcast_object_list(world, checks):
    def body():
        lst = [world.rank, "a"] if world.rank == 0 else [None, None]
        dist.broadcast_object_list(lst, src=0)
        checks.check(lst == [0, "a"], f"broadcast_object_list {lst}")

    checks.run("objects broadcast_object_list", body)


def test_gather_object(world, checks):
    def body():
        gathered = [None] * world.size if world.rank == 0 else None
        dist.gather_object(("g", world.rank), gathered, dst=0)
        if world.rank == 0:
            checks.check(gathered == [("g", r) for r in range(world.size)],
                         f"gather_object {gathered}")

    checks.run("objects gather_object", body)


def test_scatter_object_list(world, checks):
    def body():
        out = [None]
        dist.scatter_object_list(out, [("s", r) for r in range(world.size)]
                                 if world.rank == 0 else None, src=0)
        checks.check(out == [("s", world.rank)], f"scatter_object_list {out}")

    checks.run("objects scatter_object_list", body)


# --- groups -------------------------------------------------------------------------------
def test_subgroup_of_every_other_rank(world, checks):
    """Every other rank; the others call nothing but new_group."""
    def body():
        rank = world.rank
        members = list(range(0, world.size, 2))
        group = dist.new_group(members)
        if rank in members:
            checks.check(dist.get_rank(group) == members.index(rank), "group rank")
            checks.check(dist.get_world_size(group) == len(members), "group size")
            for async_op in (False, True):
                for op, dtypes in OPS.items():
                    for dtype in dtypes:
                        allreduce_case(checks, world, op, dtype, (3,), async_op, group,
                                       members)
            t = make(rank, (4,), torch.int32)
            dist.broadcast(t, src=members[-1], group=group)
            checks.check(same(t, make(members[-1], (4,), torch.int32)), "subgroup broadcast")
            outs = [torch.empty(2) for _ in members]
            dist.all_gather(outs, make(rank, (2,), torch.float32), group=group)
            checks.check(all(same(o, make(r, (2,), torch.float32))
                             for r, o in zip(members, outs, strict=True)),
                         "subgroup all_gather")
            dist.barrier(group=group)

    checks.run("subgroups every other rank", body)


def test_group_of_a_reversed_list(world, checks):
    """torch sorts a group's ranks: group rank = place in the sorted list."""
    def body():
        rank, size = world.rank, world.size
        rev = dist.new_group(list(reversed(range(size))))
        checks.check(dist.get_rank(rev) == rank, "group rank of a reversed list")
        t = torch.tensor([float(rank)])
        dist.broadcast(t, src=size - 1, group=rev)  # world rank size - 1 is group rank size - 1
        checks.check(t.item() == size - 1, f"reversed group broadcast {t}")

    checks.run("subgroups reversed list", body)


def test_new_subgroups_by_enumeration(world, checks):
    """Groups made for every rank at once (through new_group)."""
    def body():
        rank, size = world.rank, world.size
        pairs = [list(range(i, min(i + 2, size))) for i in range(0, size, 2)]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine)
        pair = pairs[rank // 2]
        checks.check(t.item() == sum(pair),
                     f"new_subgroups_by_enumeration all_reduce {t} for {pair}")

    checks.run("subgroups new_subgroups_by_enumeration", body)


@pytest.fixture
def even(world):
    """A 2 x size/2 grid of the ranks needs an even number of them."""
    if world.size % 2:
        pytest.skip("a 2 x size/2 grid needs an even number of ranks")


def test_device_mesh(world, checks, even):
    """A 2 x size/2 device mesh: both dimensions' groups are fastreduce's (made through
    new_group). dist.split_group needs a C++ backend that splits (and an accelerator): not
    this one."""
    def body():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world.size // 2), mesh_dim_names=("dp", "tp"))
        for dim in ("dp", "tp"):
            group = mesh.get_group(dim)
            checks.check(isinstance(group, frd.ProcessGroupFastreduce),
                         f"mesh {dim} group {group}")
            t = torch.tensor([float(world.rank)])
            dist.all_reduce(t, group=group)
            peers = dist.get_process_group_ranks(group)
            checks.check(t.item() == sum(peers), f"mesh {dim} all_reduce {t} over {peers}")

    checks.run("subgroups device mesh", body)


def test_partition_process_group(world, checks, even):
    """A fastreduce partition's cached sub-communicator as a torch group."""
    def body():
        rank, size = world.rank, world.size
        cart = fastreduce.Partition().create_cartesian_topology_partition([2, size // 2])
        sub = cart.create_cartesian_subtopology_partition([True, False])  # along axis 0
        pg = sub.process_group()
        checks.check(pg is sub.process_group(), "process_group() is not cached")
        checks.check(isinstance(pg, frd.ProcessGroupFastreduce) and pg.comm is sub.comm,
                     "the partition's group does not run on its communicator")
        t = make(rank, (3,), torch.float64)
        dist.all_reduce(t, group=pg)
        peers = [r for r in range(size) if r % (size // 2) == rank % (size // 2)]
        checks.check(same(t, reference([make(r, (3,), torch.float64) for r in peers], Op.SUM,
                                        torch.float64)), f"partition group all_reduce {peers}")

    checks.run("subgroups partition process group", body)


# --- bad input ----------------------------------------------------------------------------
def rejected(case: str, x: torch.Tensor, size: int):
    """(exception, words its message names, the call, tensors it must leave unchanged)."""
    return {
        "not-contiguous": (BufferError, ["not contiguous", "contiguous()"],
                           lambda: dist.all_reduce(torch.ones(4, 4).t()), ()),
        "bool-sum": (ValueError, ["bool", "sum"],
                     lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=Op.SUM), ()),
        "band-float32": (ValueError, ["band", "float32"],
                         lambda: dist.all_reduce(x, op=Op.BAND), (x,)),
        "all-gather-output-size": (
            ValueError, ["output", "elements"],
            lambda: dist.all_gather_into_tensor(torch.empty(size * 4 + 1), x), (x,)),
        "reduce-scatter-input-size": (
            ValueError, ["reduce_scatter_tensor", "input"],
            lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.empty(size * 3 + 1)), ()),
        "all-to-all-split-sizes": (
            ValueError, ["input_split_sizes"],
            lambda: dist.all_to_all_single(torch.empty(size), torch.empty(size), [1] * size,
                                           [2] * size), (x,)),
        "sparse": (frd.BackendError, ["layout", "dense"],
                   lambda: dist.broadcast(torch.eye(3).to_sparse(), src=0), ()),
        "meta": (frd.BackendError, ["meta", "cpu and cuda"],
                 lambda: dist.broadcast(torch.empty(3, device="meta"), src=0), ()),
    }[case]


@pytest.mark.parametrize("case", ["not-contiguous", "bool-sum", "band-float32",
                                  "all-gather-output-size", "reduce-scatter-input-size",
                                  "all-to-all-split-sizes", "sparse", "meta"])
def test_bad_input(world, checks, case):
    """Refused with the exception and words expected, the inputs unchanged; a failed call
    leaves the group usable."""
    def body():
        rank, size = world.rank, world.size
        x = make(rank, (4,), torch.float32)
        exc_type, words, call, unchanged = rejected(case, x, size)
        checks.expect(exc_type, words, call, *unchanged)
        t = make(rank, (2,), torch.int64)
        dist.all_reduce(t)
        checks.check(same(t, reference([make(r, (2,), torch.int64) for r in range(size)],
                                       Op.SUM, torch.int64)), "all_reduce after rejected calls")

    checks.run(f"bad input {case}", body)
