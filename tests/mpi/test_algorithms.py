"""The all-reduce algorithms (mpi, ring, rsag, hierarchical), compression, auto's choice.

For each algorithm, every dtype and op, sizes around the rank count and across the ring's
message pieces: the result matches the reduction of all ranks' inputs (exactly for integers,
bool, min and max; within reassociation for float sums and products), and every rank gets
the same bits. Then 16-bit compression of float32 (bf16, fp16) per algorithm, the entry
points (out-of-place, non-blocking, coalesced), auto's table for the job's nodes, and the
errors: a bad compression, and ranks that disagree on the algorithm.

Every case is marked across_nodes: the passes across nodes run them again on 2 nodes x 2
ranks, on 2 nodes of 2 and 1 ranks, and on 3 nodes x 1 rank (fastreduce.cluster), where auto
picks the network algorithms and hierarchical has leaders and node communicators to use.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from mpi4py import MPI
from reference import matches, ops_for, reduce, values

import fastreduce
from fastreduce import algorithms

pytestmark = pytest.mark.across_nodes

DTYPES = ["bool", "int8", "int32", "int64", "uint8", "uint64", "float16", "float32",
          "float64", "complex64"]
DTYPE_OPS = [pytest.param(dtype, op, id=f"{dtype}-{op}") for dtype in DTYPES
             for op in ops_for(dtype)]
LARGE = 70001  # several of the ring's pieces of a small dtype (2 and 3 ranks only)
BIG = 3 * (1 << 20) // 4 + 5  # float32: 3 MiB, several of the ring's 1 MiB pieces


@pytest.fixture(params=algorithms.ALGORITHMS)
def algorithm(request) -> str:
    """The algorithm every rank uses for the case (set back to the environment's after)."""
    algorithms.set_algorithm(request.param)
    yield request.param
    algorithms.set_algorithm(None)


def stack_of(dtype: str, op: str, n: int, case: str) -> np.ndarray:
    size = MPI.COMM_WORLD.size
    return np.stack([np.asarray(values(dtype, op, (n,), r, case, False)).astype(dtype)
                     for r in range(size)])


def same_everywhere(checks, result: np.ndarray, what: str) -> None:
    """Collective: every rank holds the same bits."""
    digest = zlib.crc32(np.ascontiguousarray(result).view(np.uint8).tobytes())
    checks.check(len(set(MPI.COMM_WORLD.allgather(digest))) == 1,
                 f"{what}: ranks got different bits")


def check_exact(checks, comm, algorithm: str, dtype: str, op: str, sizes) -> None:
    for n in sizes:
        case = f"{algorithm}-{dtype}-{op}-{n}"
        stack = stack_of(dtype, op, n, case)
        x = stack[comm.rank].copy()
        fastreduce.allreduce_(x, op)
        want = reduce(stack, op, comm.size)
        checks.check(matches(x, want, dtype, op, stack, comm.size), f"{case}: wrong result")
        same_everywhere(checks, x, case)


@pytest.mark.parametrize("dtype, op", DTYPE_OPS)
def test_exact(algorithm, dtype, op, comm, checks):
    """Sizes around the rank count, odd, and (float32 sum) 3 MiB: the numpy reference's
    result, the same bits on every rank."""
    sizes = [0, 1, comm.size - 1, comm.size + 1, 1031]
    check_exact(checks, comm, algorithm, dtype, op,
                sizes + ([BIG] if dtype == "float32" and op == "sum" else []))


@pytest.mark.mpi(ranks=(2, 3))
@pytest.mark.parametrize("dtype, op", DTYPE_OPS)
def test_exact_large(algorithm, dtype, op, comm, checks):
    """70001 elements: several of the ring's pieces (the runs on 1 and 4 ranks leave it out)."""
    check_exact(checks, comm, algorithm, dtype, op, [LARGE])


def _to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest even) and back."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def _to_f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


# wire -> (relative rounding, absolute rounding of float16's subnormals, rounding function)
WIRES = {"bf16": (2.0**-8, 0.0, _to_bf16), "fp16": (2.0**-11, 2.0**-25, _to_f16)}


@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
@pytest.mark.parametrize("wire", list(WIRES))
def test_compression(algorithm, wire, op, comm, checks):
    """float32 sent as 16-bit values: within 16-bit rounding of the exact reduction, the
    rounded extreme for min and max, the same bits on every rank."""
    eps, tiny, to16 = WIRES[wire]
    for n in (1, 1031, BIG):
        case = f"{algorithm}-{wire}-{op}-{n}"
        stack = stack_of("float32", op, n, case)
        x = stack[comm.rank].copy()
        fastreduce.allreduce_(x, op, compression=wire)
        same_everywhere(checks, x, case)
        exact = reduce(stack.astype(np.float64), op, comm.size)
        if op in ("min", "max"):  # rounding is monotonic: the rounded extreme
            checks.check(np.array_equal(x, to16(exact.astype(np.float32))),
                         f"{case}: not the rounded {op}")
            continue
        scale = np.abs(stack.astype(np.float64)).sum(axis=0)
        if op == "avg":
            scale /= comm.size
        bound = 2 * (comm.size + 1) * (eps * scale + tiny)
        checks.check(bool(np.all(np.abs(x - exact) <= bound)),
                     f"{case}: error {np.max(np.abs(x - exact)):.3g} beyond 16-bit rounding")
        if op == "sum":  # (avg divides the 16-bit sum in float32)
            checks.check(np.array_equal(x, to16(x)), f"{case}: result is not 16-bit values")


def test_entry_points(algorithm, comm, checks):
    """allreduce (out of place), iallreduce, iallreduce_ with bf16, allreduce_coalesced_."""
    import torch

    n = 40001
    stack = stack_of("float64", "sum", n, f"entry-{algorithm}")
    want = reduce(stack, "sum", comm.size)
    mine = torch.from_numpy(stack[comm.rank].copy())
    out = fastreduce.allreduce(mine)
    checks.check(matches(out.numpy(), want, "float64", "sum", stack, comm.size)
                 and np.array_equal(mine.numpy(), stack[comm.rank]), f"{algorithm}: allreduce")
    result = fastreduce.iallreduce(mine, compression=None).wait()
    checks.check(np.array_equal(result.numpy(), out.numpy()), f"{algorithm}: iallreduce")
    x = mine.float().clone()
    fastreduce.iallreduce_(x, compression="bf16").wait()
    y = mine.float().clone()
    fastreduce.allreduce_(y, compression="bf16")
    checks.check(torch.equal(x, y),
                 f"{algorithm}: iallreduce_ with bf16 differs from allreduce_")
    parts = [mine[:1000].clone(), torch.arange(7, dtype=torch.int64) * (comm.rank + 1),
             mine[1000:].clone()]
    fastreduce.allreduce_coalesced_(parts)
    checks.check(torch.equal(torch.cat([parts[0], parts[2]]), out)
                 or matches(torch.cat([parts[0], parts[2]]).numpy(), want, "float64", "sum",
                            stack, comm.size), f"{algorithm}: coalesced floats")
    triangle = comm.size * (comm.size + 1) // 2
    checks.check(torch.equal(parts[1], torch.arange(7, dtype=torch.int64) * triangle),
                 f"{algorithm}: coalesced int64")


def test_auto_table(comm, checks):
    """auto's steps and segments for the job's nodes, and a 3 MiB sum on its network
    algorithm."""
    algorithms.set_algorithm("auto")
    try:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        nodes = comm.allreduce(1 if local.rank == 0 else 0)
        most = comm.allreduce(local.size, op=MPI.MAX)
        local.Free()
        steps = algorithms.plan()["steps"]
        network = (algorithms.NETWORK_FROM, "ring" if most == 1 else "hierarchical")
        if nodes == 1 or (most > 1 and fastreduce.build_mpi()[0] == "Open MPI"):
            want = ((0, "mpi"),)
        else:
            want = ((0, "mpi"), network)
        checks.check(steps == want, f"auto on {nodes} nodes (at most {most} ranks on one): "
                                    f"{steps}")
        segment = algorithms.plan()["segment_bytes"]
        checks.check(segment == (4 << 20 if nodes == 1 else 0),
                     f"segments on {nodes} nodes: {segment}")
        x = np.full(3 << 18, comm.rank + 1.0, np.float32)  # 3 MiB: auto's network algorithm
        fastreduce.allreduce_(x)
        checks.check(bool(np.all(x == comm.size * (comm.size + 1) / 2)), "auto: 3 MiB sum")
    finally:
        algorithms.set_algorithm(None)


def test_bad_settings(checks):
    """A compression for an integer dtype or of an unknown name, an unknown algorithm:
    ValueError, nothing changed; segments pinned and unpinned again."""
    x = np.arange(5, dtype=np.int32)
    checks.expect(ValueError, ["compression", "float32", "int32"],
                  lambda: fastreduce.allreduce_(x, compression="bf16"), x)
    y = np.ones(5, np.float32)
    checks.expect(ValueError, ["compression", "'zip'", "bf16"],
                  lambda: fastreduce.allreduce_(y, compression="zip"), y)
    checks.expect(ValueError, ["algorithm", "'fastest'"],
                  lambda: algorithms.set_algorithm("fastest"))
    old = fastreduce.runtime.set_segment_bytes(0)
    checks.check(old is None and fastreduce.runtime.set_segment_bytes(old) == 0
                 and not fastreduce.backend.reduce.segment_bytes_pinned(),
                 f"segments pinned and unpinned again: {old}")


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_ring_messages_never_meet_the_applications(comm, checks):
    """A wildcard receive posted before the ring's all-reduce gets the application's message,
    not one of the ring's."""
    dup = comm.Dup()
    algorithms.set_algorithm("ring")
    try:
        pending = dup.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        w = np.ones(5000)
        fastreduce.allreduce_(w, comm=dup)
        dup.send(("application", comm.rank), dest=(comm.rank + 1) % comm.size, tag=7)
        got = pending.wait()
    finally:
        algorithms.set_algorithm(None)
    checks.check(got == ("application", (comm.rank - 1) % comm.size)
                 and bool(np.all(w == comm.size)), f"a wildcard receive during the ring got "
                                                   f"{got!r}")
    dup.Free()


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_ranks_that_disagree(comm, checks):
    """Ranks set to different algorithms: a ValueError on every rank, nothing reduced; the
    next call, agreed again, works."""
    algorithms.set_algorithm("ring" if comm.rank == 0 else "mpi")
    try:
        z = np.full(9, comm.rank + 1.0)
        checks.expect(ValueError, ["disagree", "algorithm", "FASTREDUCE_ALGORITHM"],
                      lambda: fastreduce.allreduce_(z), z)
    finally:
        algorithms.set_algorithm(None)
    fastreduce.allreduce_(z)
    checks.check(bool(np.all(z == comm.size * (comm.size + 1) / 2)), "after a disagreement")


def test_training_with_compression(process_group, comm, checks):
    """GradientSync and DDP's hook with bf16 compression: every rank the same model, and
    200 steps of training end within 1% of float32's loss."""
    import torch

    import fastreduce.distributed

    algorithms.set_algorithm(None)

    def train(wrap, steps=200):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1))
        model, attach = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        attach(opt)
        data = torch.Generator().manual_seed(100 + comm.rank)
        xs = torch.randn(steps, 8, 16, generator=data)
        target = torch.nn.Linear(16, 1)
        torch.nn.init.constant_(target.weight, 0.3)
        loss = None
        for i in range(steps):
            opt.zero_grad()
            with torch.no_grad():
                y = target(xs[i])
            loss = (model(xs[i]) - y).square().mean()
            loss.backward()
            opt.step()
        final = comm.allreduce(float(loss)) / comm.size
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        return final, params

    def sync(compression):
        def wrap(model):
            s = fastreduce.GradientSync(model, compression=compression)
            return model, s.attach
        return wrap

    def ddp(hook):
        def wrap(model):
            m = torch.nn.parallel.DistributedDataParallel(model)
            m.register_comm_hook(None, hook)
            return m, lambda opt: None
        return wrap

    base, _ = train(sync(None))
    for name, wrap in (("GradientSync bf16", sync("bf16")), ("GradientSync fp16", sync("fp16")),
                       ("DDP bf16 hook", ddp(fastreduce.distributed.bf16_compression_hook)),
                       ("DDP fp16 hook", ddp(fastreduce.distributed.fp16_compression_hook))):
        loss, params = train(wrap)
        same_everywhere(checks, params.numpy(), f"{name}: parameters")
        checks.check(abs(loss - base) <= 0.01 * abs(base),
                     f"{name}: final loss {loss:.6g}, float32's {base:.6g}: beyond 1%")
        if comm.rank == 0:
            print(f"200 steps, {name}: final loss {loss:.6g} (float32 {base:.6g}, "
                  f"{(loss - base) / base:+.3%})", flush=True)
    checks.expect(ValueError, ["compression", "'zip'"],
                  lambda: fastreduce.GradientSync(torch.nn.Linear(2, 2), compression="zip"))
