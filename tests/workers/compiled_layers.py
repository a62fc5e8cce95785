"""torch.compile over fastreduce's layers and ops: zero graph breaks under fullgraph, compiled
equal to eager (forward and backward, float64 with integer-valued inputs: exact), dynamic
shapes, the adjoint test through the compiled path, no recompilation for a second call, the
custom op used only while compiling, inactive workers."""

from __future__ import annotations

import torch
import torch._dynamo
from common import WORLD, Failures
from torch._dynamo.testing import CompileCounterWithBackend

import fastreduce
import fastreduce.ops
from fastreduce.nn import AllReduce, AllSumReduce

f = Failures()
p, rank = WORLD.size, WORLD.rank
rows = 2 if p % 2 == 0 else 1
P = fastreduce.Partition().create_cartesian_topology_partition([rows, p // rows])
torch.manual_seed(0)  # same Linear weights on every rank


def ints(seed, *shape, requires_grad=False):
    """Integer-valued float64: sums and products are exact, whatever the order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, shape, generator=g).to(torch.float64)
    return x.requires_grad_(requires_grad)


class Block(torch.nn.Module):
    """Linear layers (integer weights) alternating with a reduction layer."""

    def __init__(self, reduce):
        super().__init__()
        self.a = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.b = torch.nn.Linear(6, 6, dtype=torch.float64)
        with torch.no_grad():
            for lin in (self.a, self.b):
                lin.weight.copy_(ints(3, 6, 6))
                lin.bias.copy_(ints(4, 6))
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(self.b(self.reduce(self.a(x))))


LAYERS = {
    "AllSumReduce": lambda: AllSumReduce(P, axes_reduce=[1]),
    "AllSumReduce all axes": lambda: AllSumReduce(P, axes_reduce=[0, 1]),
    "AllReduce identity": lambda: AllReduce(op="sum", backward="identity"),
    "AllReduce sum": lambda: AllReduce(op="sum", backward="sum"),
    "AllReduce avg": lambda: AllReduce(op="avg", backward="sum"),
    "all_sum_reduce": lambda: (lambda x: fastreduce.all_sum_reduce(x, P, [1])),
    "all_reduce": lambda: (lambda x: fastreduce.all_reduce(x, None, "sum", "sum")),
}


def run(model, x):
    """Forward and backward: (output, input gradient, parameter gradients)."""
    x = x.detach().clone().requires_grad_(True)
    for q in model.parameters():
        q.grad = None
    y = model(x)
    (y * ints(50 + rank, *y.shape)).sum().backward()
    return y.detach(), x.grad, [q.grad.clone() for q in model.parameters()]


def same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-13, atol=1e-13)


def check_layer(name, make):
    # "avg" divides by the size: equal to rounding there, bit for bit elsewhere
    _check_layer(name, make, close if "avg" in name else same)


def _check_layer(name, make, eq):
    model = Block(make())
    x = ints(10 + rank, 5, 6)
    explained = torch._dynamo.explain(model)(x)
    f.check(explained.graph_break_count == 0,
            f"{name}: {explained.graph_break_count} graph breaks: {explained.break_reasons}")
    eager = run(model, x)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = run(compiled, x)
    f.check(eq(got[0], eager[0]), f"{name}: compiled forward differs from eager")
    f.check(eq(got[1], eager[1]), f"{name}: compiled input gradient differs")
    f.check(all(eq(a, b) for a, b in zip(got[2], eager[2], strict=True)),
            f"{name}: compiled parameter gradients differ")
    frames = counter.frame_count
    again = run(compiled, ints(20 + rank, 5, 6))
    f.check(counter.frame_count == frames, f"{name}: a second call with the same shapes "
                                           f"recompiled ({frames} -> {counter.frame_count})")
    f.check(eq(again[0], run(model, ints(20 + rank, 5, 6))[0]), f"{name}: second call value")
    # dynamic shapes: other batch sizes through one graph
    dyn = torch.compile(model, fullgraph=True, dynamic=True)
    for batch in (3, 7):
        xb = ints(30 + rank + batch, batch, 6)
        got, want = run(dyn, xb), run(model, xb)
        f.check(eq(got[0], want[0]) and eq(got[1], want[1]),
                f"{name}: dynamic=True batch {batch} differs from eager")


def check_adjoint():
    """<F x, y> == <x, F* y> summed over ranks, F and F* from the compiled layer."""
    for axes in ([0], [1], [0, 1]):
        layer = AllSumReduce(P, axes_reduce=axes)
        compiled = torch.compile(layer, fullgraph=True)
        g = torch.Generator().manual_seed(70 + rank)
        x = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
        y = torch.randn(4, 3, generator=g, dtype=torch.float64)
        fx = compiled(x)
        fx.backward(y)
        lhs = WORLD.allreduce(float((fx.detach() * y).sum()))
        rhs = WORLD.allreduce(float((x.detach() * x.grad).sum()))
        gap = abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300)
        f.check(gap <= 1e-12, f"compiled AllSumReduce{axes} adjoint gap {gap:.2e}")


def check_custom_op_only_when_compiling():
    """Eager layer calls go straight to the core; compiled ones through the custom op."""
    calls = []
    original = fastreduce.ops._reduced

    def counting(*args):
        calls.append(args)
        return original(*args)

    fastreduce.ops._reduced = counting
    try:
        for name, reduces in (("AllSumReduce", p // rows > 1), ("AllReduce sum", p > 1)):
            layer = LAYERS[name]()
            x = ints(40 + rank, 4, 6, requires_grad=True)
            layer(x).sum().backward()
            layer(x.detach())
            f.check(not calls, f"{name}: eager calls went through the custom op ({len(calls)})")
            calls.clear()
            torch.compile(layer, fullgraph=True)(x.detach())
            f.check(len(calls) == int(reduces),
                    f"{name}: compiled call made {len(calls)} custom op calls, want "
                    f"{int(reduces)}")
            calls.clear()
    finally:
        fastreduce.ops._reduced = original


def check_guards_on_communicators():
    """One compiled function called with two communicators, and with two partitions:
    dynamo must not reuse the first one's communicator for the second."""
    pairs = WORLD.Split(rank // 2, rank)

    @torch.compile(fullgraph=True)
    def tp(x, comm):
        return fastreduce.all_reduce(x, comm, "sum", "identity")

    x = ints(90 + rank, 3)
    for comm in (WORLD, pairs, WORLD):
        want = fastreduce.allreduce(x, comm=comm)
        f.check(same(tp(x, comm), want), f"compiled all_reduce on a communicator of "
                                         f"{comm.Get_size()}: wrong group")
    Q = fastreduce.Partition(pairs).create_cartesian_topology_partition([pairs.Get_size()])

    @torch.compile(fullgraph=True)
    def summed(x, part):
        return fastreduce.all_sum_reduce(x, part, [0])

    P1 = fastreduce.Partition().create_cartesian_topology_partition([p])
    for part, comm in ((P1, WORLD), (Q, pairs), (P1, WORLD)):
        f.check(same(summed(x, part), fastreduce.allreduce(x, comm=comm)),
                f"compiled all_sum_reduce over a partition of {comm.Get_size()}: wrong group")


def check_tensor_ops():
    """fastreduce.ops.allreduce / allreduce_: the core all-reduce as traceable ops."""
    def fn(x):
        y = fastreduce.ops.allreduce(x * 2, "max")
        z = x + 1
        fastreduce.ops.allreduce_(z, "sum")
        return y + z

    x = ints(60 + rank, 8)
    explained = torch._dynamo.explain(fn)(x)
    f.check(explained.graph_break_count == 0, f"tensor ops: {explained.break_reasons}")
    got = torch.compile(fn, fullgraph=True)(x)
    want = fastreduce.allreduce(x * 2, "max") + fastreduce.allreduce(x + 1, "sum")
    f.check(same(got, want), f"tensor ops compiled: {got} want {want}")
    f.check(same(fn(x), want), "tensor ops eager")


def check_inactive_workers():
    """A partition of one worker: the others are inactive and pass zero-volume tensors."""
    Q = fastreduce.Partition().create_cartesian_topology_partition([1, 1])
    layer = AllSumReduce(Q, axes_reduce=[0])
    compiled = torch.compile(layer, fullgraph=True)
    if Q.active:
        x = ints(80, 3, 2)
        f.check(same(compiled(x), x), "active single worker: identity")
    else:
        z = fastreduce.zero_volume_tensor(dtype=torch.float64, requires_grad=True)
        out = compiled(z)
        out.sum().backward()
        f.check(out.shape == (0,) and z.grad.shape == (0,), "inactive worker: zero volume")


for name, make in LAYERS.items():
    f.run(name, check_layer, name, make)
f.run("adjoint", check_adjoint)
f.run("custom op only when compiling", check_custom_op_only_when_compiling)
f.run("tensor ops", check_tensor_ops)
f.run("guards on communicators", check_guards_on_communicators)
f.run("inactive workers", check_inactive_workers)
f.finish()
