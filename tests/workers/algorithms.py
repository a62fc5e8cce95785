"""Every all-reduce algorithm (mpi, ring, rsag, hierarchical) against a numpy reference.

For each algorithm, every dtype and op, sizes around the rank count and across the ring's
message pieces: the result matches the reduction of all ranks' inputs (exactly for integers,
bool, min and max; within reassociation for float sums and products), and every rank gets
the same bits. Then 16-bit compression of float32 (bf16, fp16) per algorithm, the entry
points (out-of-place, non-blocking, coalesced), auto's table for the job's nodes, and the
errors: a bad compression, and ranks that disagree on the algorithm.

Usage: algorithms.py [--quick]
"""

from __future__ import annotations

import sys
import zlib

import numpy as np
from common import WORLD, Failures
from mpi4py import MPI
from reference import matches, ops_for, reduce, values

import fastreduce
from fastreduce import algorithms

DTYPES = ["bool", "int8", "int32", "int64", "uint8", "uint64", "float16", "float32",
          "float64", "complex64"]
QUICK = "--quick" in sys.argv
# around the rank count, odd, and (float32) 3 MiB: several of the ring's 1 MiB pieces
SIZES = [0, 1, WORLD.size - 1, WORLD.size + 1, 1031] + ([] if QUICK else [70001])
BIG = 3 * (1 << 20) // 4 + 5
f = Failures()


def stack_of(dtype: str, op: str, n: int, case: str) -> np.ndarray:
    return np.stack([np.asarray(values(dtype, op, (n,), r, case, False)).astype(dtype)
                     for r in range(WORLD.size)])


def same_everywhere(result: np.ndarray, what: str) -> None:
    digest = zlib.crc32(np.ascontiguousarray(result).view(np.uint8).tobytes())
    f.check(len(set(WORLD.allgather(digest))) == 1, f"{what}: ranks got different bits")


def check_exact_algorithm(algorithm: str) -> None:
    algorithms.set_algorithm(algorithm)
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in SIZES + ([BIG] if dtype == "float32" and op == "sum" else []):
                case = f"{algorithm}-{dtype}-{op}-{n}"
                stack = stack_of(dtype, op, n, case)
                x = stack[WORLD.rank].copy()
                fastreduce.allreduce_(x, op)
                want = reduce(stack, op, WORLD.size)
                f.check(matches(x, want, dtype, op, stack, WORLD.size), f"{case}: wrong result")
                same_everywhere(x, case)


def check_compression(algorithm: str) -> None:
    algorithms.set_algorithm(algorithm)
    # (relative rounding, absolute rounding of float16's subnormals, rounding function)
    for wire, eps, tiny, to16 in (("bf16", 2.0**-8, 0.0, _to_bf16),
                                  ("fp16", 2.0**-11, 2.0**-25, _to_f16)):
        for op in ("sum", "avg", "min", "max"):
            for n in (1, 1031, BIG):
                case = f"{algorithm}-{wire}-{op}-{n}"
                stack = stack_of("float32", op, n, case)
                x = stack[WORLD.rank].copy()
                fastreduce.allreduce_(x, op, compression=wire)
                same_everywhere(x, case)
                exact = reduce(stack.astype(np.float64), op, WORLD.size)
                if op in ("min", "max"):  # rounding is monotonic: the rounded extreme
                    f.check(np.array_equal(x, to16(exact.astype(np.float32))),
                            f"{case}: not the rounded {op}")
                    continue
                scale = np.abs(stack.astype(np.float64)).sum(axis=0)
                if op == "avg":
                    scale /= WORLD.size
                bound = 2 * (WORLD.size + 1) * (eps * scale + tiny)
                f.check(bool(np.all(np.abs(x - exact) <= bound)),
                        f"{case}: error {np.max(np.abs(x - exact)):.3g} beyond 16-bit rounding")
                if op == "sum":  # (avg divides the 16-bit sum in float32)
                    f.check(np.array_equal(x, to16(x)), f"{case}: result is not 16-bit values")


def _to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest even) and back."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def _to_f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def check_entry_points(algorithm: str) -> None:
    import torch

    algorithms.set_algorithm(algorithm)
    n = 40001
    stack = stack_of("float64", "sum", n, f"entry-{algorithm}")
    want = reduce(stack, "sum", WORLD.size)
    mine = torch.from_numpy(stack[WORLD.rank].copy())
    out = fastreduce.allreduce(mine)
    f.check(matches(out.numpy(), want, "float64", "sum", stack, WORLD.size)
            and np.array_equal(mine.numpy(), stack[WORLD.rank]), f"{algorithm}: allreduce")
    result = fastreduce.iallreduce(mine, compression=None).wait()
    f.check(np.array_equal(result.numpy(), out.numpy()), f"{algorithm}: iallreduce")
    x = mine.float().clone()
    fastreduce.iallreduce_(x, compression="bf16").wait()
    y = mine.float().clone()
    fastreduce.allreduce_(y, compression="bf16")
    f.check(torch.equal(x, y), f"{algorithm}: iallreduce_ with bf16 differs from allreduce_")
    parts = [mine[:1000].clone(), torch.arange(7, dtype=torch.int64) * (WORLD.rank + 1),
             mine[1000:].clone()]
    fastreduce.allreduce_coalesced_(parts)
    f.check(torch.equal(torch.cat([parts[0], parts[2]]), out)
            or matches(torch.cat([parts[0], parts[2]]).numpy(), want, "float64", "sum", stack,
                       WORLD.size), f"{algorithm}: coalesced floats")
    triangle = WORLD.size * (WORLD.size + 1) // 2
    f.check(torch.equal(parts[1], torch.arange(7, dtype=torch.int64) * triangle),
            f"{algorithm}: coalesced int64")


def check_auto_table() -> None:
    algorithms.set_algorithm("auto")
    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    nodes = WORLD.allreduce(1 if local.rank == 0 else 0)
    most = WORLD.allreduce(local.size, op=MPI.MAX)
    local.Free()
    steps = algorithms.plan()["steps"]
    network = (algorithms.NETWORK_FROM, "ring" if most == 1 else "hierarchical")
    if nodes == 1 or (most > 1 and fastreduce.build_mpi()[0] == "Open MPI"):
        want = ((0, "mpi"),)
    else:
        want = ((0, "mpi"), network)
    f.check(steps == want, f"auto on {nodes} nodes (at most {most} ranks on one): {steps}")
    segment = algorithms.plan()["segment_bytes"]
    f.check(segment == (4 << 20 if nodes == 1 else 0), f"segments on {nodes} nodes: {segment}")
    x = np.full(3 << 18, WORLD.rank + 1.0, np.float32)  # 3 MiB: auto's network algorithm
    fastreduce.allreduce_(x)
    f.check(bool(np.all(x == WORLD.size * (WORLD.size + 1) / 2)), "auto: 3 MiB sum")


def check_errors() -> None:
    x = np.arange(5, dtype=np.int32)
    f.expect(ValueError, ["compression", "float32", "int32"],
             lambda: fastreduce.allreduce_(x, compression="bf16"), x)
    y = np.ones(5, np.float32)
    f.expect(ValueError, ["compression", "'zip'", "bf16"],
             lambda: fastreduce.allreduce_(y, compression="zip"), y)
    f.expect(ValueError, ["algorithm", "'fastest'"],
             lambda: algorithms.set_algorithm("fastest"))
    old = fastreduce.runtime.set_segment_bytes(0)
    f.check(old is None and fastreduce.runtime.set_segment_bytes(old) == 0
            and not fastreduce.backend.reduce.segment_bytes_pinned(),
            f"segments pinned and unpinned again: {old}")
    if WORLD.size == 1:
        return
    # the ring's messages never meet the application's, not even a wildcard receive
    comm = WORLD.Dup()
    algorithms.set_algorithm("ring")
    pending = comm.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    w = np.ones(5000)
    fastreduce.allreduce_(w, comm=comm)
    comm.send(("application", WORLD.rank), dest=(WORLD.rank + 1) % WORLD.size, tag=7)
    got = pending.wait()
    f.check(got == ("application", (WORLD.rank - 1) % WORLD.size) and bool(np.all(w == WORLD.size)),
            f"a wildcard receive during the ring got {got!r}")
    comm.Free()
    # ranks that disagree: a ValueError on every rank, nothing reduced
    algorithms.set_algorithm("ring" if WORLD.rank == 0 else "mpi")
    z = np.full(9, WORLD.rank + 1.0)
    f.expect(ValueError, ["disagree", "algorithm", "FASTREDUCE_ALGORITHM"],
             lambda: fastreduce.allreduce_(z), z)
    algorithms.set_algorithm(None)
    fastreduce.allreduce_(z)
    f.check(bool(np.all(z == WORLD.size * (WORLD.size + 1) / 2)), "after a disagreement")


def check_training() -> None:
    """GradientSync and DDP's hook with bf16 compression: every rank the same model, and
    200 steps of training end within 1% of float32's loss."""
    import torch
    import torch.distributed as dist

    import fastreduce.distributed

    algorithms.set_algorithm(None)
    if not dist.is_initialized():
        dist.init_process_group("fastreduce")

    def train(wrap, steps=200):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1))
        model, attach = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        attach(opt)
        data = torch.Generator().manual_seed(100 + WORLD.rank)
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
        final = WORLD.allreduce(float(loss)) / WORLD.size
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
        same_everywhere(params.numpy(), f"{name}: parameters")
        f.check(abs(loss - base) <= 0.01 * abs(base),
                f"{name}: final loss {loss:.6g}, float32's {base:.6g}: beyond 1%")
        if WORLD.rank == 0:
            print(f"200 steps, {name}: final loss {loss:.6g} (float32 {base:.6g}, "
                  f"{(loss - base) / base:+.3%})", flush=True)
    f.expect(ValueError, ["compression", "'zip'"],
             lambda: fastreduce.GradientSync(torch.nn.Linear(2, 2), compression="zip"))


for name in algorithms.ALGORITHMS:
    f.run(f"{name}: dtypes x ops x sizes", check_exact_algorithm, name)
    f.run(f"{name}: compression", check_compression, name)
    f.run(f"{name}: entry points", check_entry_points, name)
f.run("auto's table", check_auto_table)
f.run("errors", check_errors)
f.run("training with compression", check_training)
algorithms.set_algorithm(None)
f.finish()
