"""torch.compile over fastreduce's layers and ops.

With fullgraph (torch 2.12 and newer, where fastreduce.ops.TRACEABLE): zero graph breaks,
compiled equal to eager (forward and backward, float64 with integer-valued inputs: exact),
dynamic shapes, the adjoint test through the compiled path, no recompilation for a second
call, the custom op used only while compiling, guards on communicators, inactive workers.

Without fullgraph, on every torch: eager's results, traced through the custom ops where
fastreduce.ops.TRACEABLE, run eagerly with graph breaks around them on older torch.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from mpi4py import MPI
from torch._dynamo.testing import CompileCounterWithBackend

import fastreduce
import fastreduce.ops
from fastreduce.nn import AllReduce, AllSumReduce

pytestmark = [pytest.mark.timeout(600), pytest.mark.one_mpi]

WORLD = MPI.COMM_WORLD
p, rank = WORLD.size, WORLD.rank
rows = 2 if p % 2 == 0 else 1

on_1_to_4_ranks = pytest.mark.mpi(ranks=(1, 2, 3, 4))
# the layers compiled with inductor (seconds each, a session's first compile far more) where
# their reductions are not trivial: a 1 x 3 grid and a 2 x 2 one (on 1 and 2 ranks the
# reduced axis has one rank)
on_grids_that_reduce = pytest.mark.mpi(ranks=(3, 4))
traceable = pytest.mark.skipif(not fastreduce.ops.TRACEABLE,
                               reason="torch older than 2.12 does not trace fastreduce's ops "
                                      "(documented); test_fallback checks what it does instead")


@pytest.fixture(scope="module")
def P():
    """A rows x cols grid over every rank (2 rows where the size is even)."""
    torch.manual_seed(0)  # same Linear weights on every rank
    return fastreduce.Partition().create_cartesian_topology_partition([rows, p // rows])


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
    "AllSumReduce": lambda P: AllSumReduce(P, axes_reduce=[1]),
    "AllSumReduce all axes": lambda P: AllSumReduce(P, axes_reduce=[0, 1]),
    "AllReduce identity": lambda P: AllReduce(op="sum", backward="identity"),
    "AllReduce sum": lambda P: AllReduce(op="sum", backward="sum"),
    "AllReduce avg": lambda P: AllReduce(op="avg", backward="sum"),
    "all_sum_reduce": lambda P: (lambda x: fastreduce.all_sum_reduce(x, P, [1])),
    "all_reduce": lambda P: (lambda x: fastreduce.all_reduce(x, None, "sum", "sum")),
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


@on_grids_that_reduce
@traceable
@pytest.mark.parametrize("name", list(LAYERS), ids=[n.replace(" ", "-") for n in LAYERS])
def test_layer(checks, P, name):
    """No graph break under fullgraph; compiled forward and backward equal eager; no
    recompilation for a second call; dynamic=True batch sizes through one graph."""
    # "avg" divides by the size: equal to rounding there, bit for bit elsewhere
    checks.run(name, _check_layer, checks, name, lambda: LAYERS[name](P),
               close if "avg" in name else same)


def _check_layer(checks, name, make, eq):
    model = Block(make())
    x = ints(10 + rank, 5, 6)
    explained = torch._dynamo.explain(model)(x)
    checks.check(explained.graph_break_count == 0,
                 f"{name}: {explained.graph_break_count} graph breaks: "
                 f"{explained.break_reasons}")
    eager = run(model, x)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = run(compiled, x)
    checks.check(eq(got[0], eager[0]), f"{name}: compiled forward differs from eager")
    checks.check(eq(got[1], eager[1]), f"{name}: compiled input gradient differs")
    checks.check(all(eq(a, b) for a, b in zip(got[2], eager[2], strict=True)),
                 f"{name}: compiled parameter gradients differ")
    frames = counter.frame_count
    again = run(compiled, ints(20 + rank, 5, 6))
    checks.check(counter.frame_count == frames,
                 f"{name}: a second call with the same shapes recompiled "
                 f"({frames} -> {counter.frame_count})")
    checks.check(eq(again[0], run(model, ints(20 + rank, 5, 6))[0]),
                 f"{name}: second call value")
    # dynamic shapes: other batch sizes through one graph
    dyn = torch.compile(model, fullgraph=True, dynamic=True)
    for batch in (3, 7):
        xb = ints(30 + rank + batch, batch, 6)
        got, want = run(dyn, xb), run(model, xb)
        checks.check(eq(got[0], want[0]) and eq(got[1], want[1]),
                     f"{name}: dynamic=True batch {batch} differs from eager")


@on_1_to_4_ranks
@traceable
def test_adjoint(checks, P):
    """<F x, y> == <x, F* y> summed over ranks, F and F* from the compiled layer."""
    def body():
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
            checks.check(gap <= 1e-12, f"compiled AllSumReduce{axes} adjoint gap {gap:.2e}")

    checks.run("adjoint", body)


@on_1_to_4_ranks
@traceable
def test_custom_op_only_when_compiling(checks, P, monkeypatch):
    """Eager layer calls go straight to the core; compiled ones through the custom op."""
    calls = []
    original = fastreduce.ops._reduced

    def counting(*args):
        calls.append(args)
        return original(*args)

    def body():
        monkeypatch.setattr(fastreduce.ops, "_reduced", counting)
        for name, reduces in (("AllSumReduce", p // rows > 1), ("AllReduce sum", p > 1)):
            layer = LAYERS[name](P)
            x = ints(40 + rank, 4, 6, requires_grad=True)
            layer(x).sum().backward()
            layer(x.detach())
            checks.check(not calls,
                         f"{name}: eager calls went through the custom op ({len(calls)})")
            calls.clear()
            torch.compile(layer, fullgraph=True)(x.detach())
            checks.check(len(calls) == int(reduces),
                         f"{name}: compiled call made {len(calls)} custom op calls, want "
                         f"{int(reduces)}")
            calls.clear()

    checks.run("custom op only when compiling", body)


@on_1_to_4_ranks
@traceable
def test_tensor_ops(checks):
    """fastreduce.ops.allreduce / allreduce_: the core all-reduce as traceable ops."""
    def fn(x):
        y = fastreduce.ops.allreduce(x * 2, "max")
        z = x + 1
        fastreduce.ops.allreduce_(z, "sum")
        return y + z

    def body():
        x = ints(60 + rank, 8)
        explained = torch._dynamo.explain(fn)(x)
        checks.check(explained.graph_break_count == 0, f"tensor ops: {explained.break_reasons}")
        got = torch.compile(fn, fullgraph=True)(x)
        want = fastreduce.allreduce(x * 2, "max") + fastreduce.allreduce(x + 1, "sum")
        checks.check(same(got, want), f"tensor ops compiled: {got} want {want}")
        checks.check(same(fn(x), want), "tensor ops eager")

    checks.run("tensor ops", body)


@on_1_to_4_ranks
@traceable
def test_guards_on_communicators(checks):
    """One compiled function called with two communicators, and with two partitions:
    dynamo must not reuse the first one's communicator for the second."""
    def body():
        pairs = WORLD.Split(rank // 2, rank)

        @torch.compile(fullgraph=True)
        def tp(x, comm):
            return fastreduce.all_reduce(x, comm, "sum", "identity")

        x = ints(90 + rank, 3)
        for comm in (WORLD, pairs, WORLD):
            want = fastreduce.allreduce(x, comm=comm)
            checks.check(same(tp(x, comm), want), f"compiled all_reduce on a communicator of "
                                                  f"{comm.Get_size()}: wrong group")
        Q = fastreduce.Partition(pairs).create_cartesian_topology_partition([pairs.Get_size()])

        @torch.compile(fullgraph=True)
        def summed(x, part):
            return fastreduce.all_sum_reduce(x, part, [0])

        P1 = fastreduce.Partition().create_cartesian_topology_partition([p])
        for part, comm in ((P1, WORLD), (Q, pairs), (P1, WORLD)):
            checks.check(same(summed(x, part), fastreduce.allreduce(x, comm=comm)),
                         f"compiled all_sum_reduce over a partition of {comm.Get_size()}: "
                         f"wrong group")

    checks.run("guards on communicators", body)


@on_1_to_4_ranks
@traceable
def test_inactive_workers(checks):
    """A partition of one worker: the others are inactive and pass zero-volume tensors."""
    def body():
        Q = fastreduce.Partition().create_cartesian_topology_partition([1, 1])
        layer = AllSumReduce(Q, axes_reduce=[0])
        compiled = torch.compile(layer, fullgraph=True)
        if Q.active:
            x = ints(80, 3, 2)
            checks.check(same(compiled(x), x), "active single worker: identity")
        else:
            z = fastreduce.zero_volume_tensor(dtype=torch.float64, requires_grad=True)
            out = compiled(z)
            out.sum().backward()
            checks.check(out.shape == (0,) and z.grad.shape == (0,),
                         "inactive worker: zero volume")

    checks.run("inactive workers", body)


# --- without fullgraph: eager's results on every torch -------------------------------------
class FallbackBlock(torch.nn.Module):
    def __init__(self, reduce):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6, dtype=torch.float64)
        with torch.no_grad():
            self.lin.weight.copy_(ints(3, 6, 6))
            self.lin.bias.copy_(ints(4, 6))
        self.reduce = reduce

    def forward(self, x):
        return self.lin(self.reduce(self.lin(x)) * 2)


def run_fallback(model, x):
    x = x.detach().clone().requires_grad_(True)
    for q in model.parameters():
        q.grad = None
    y = model(x)
    (y * ints(50 + rank, *y.shape)).sum().backward()
    return [y.detach(), x.grad, *[q.grad.clone() for q in model.parameters()]]


FALLBACK_LAYERS = {
    "AllSumReduce": lambda P: AllSumReduce(P, axes_reduce=[1]),
    "AllReduce identity": lambda P: AllReduce(op="sum", backward="identity"),
    "AllReduce sum": lambda P: AllReduce(op="sum", backward="sum"),
    "all_sum_reduce": lambda P: (lambda x: fastreduce.all_sum_reduce(x, P, [1])),
    "all_reduce": lambda P: (lambda x: fastreduce.all_reduce(x, None, "sum", "sum")),
}


@pytest.fixture(scope="module")
def row():
    """One row of every rank: [1, p]."""
    return fastreduce.Partition().create_cartesian_topology_partition([1, p])


@pytest.mark.mpi(ranks=2)
@pytest.mark.minimum_versions
@pytest.mark.parametrize("name", list(FALLBACK_LAYERS),
                         ids=[n.replace(" ", "-") for n in FALLBACK_LAYERS])
def test_fallback(checks, row, name):
    """torch.compile without fullgraph gives eager's results on every torch (traced, or with
    graph breaks around the layers on torch older than 2.12)."""
    model = FallbackBlock(FALLBACK_LAYERS[name](row))
    x = ints(10 + rank, 5, 6)
    eager = run_fallback(model, x)
    compiled = torch.compile(model)
    for attempt in range(2):
        got = run_fallback(compiled, x)
        checks.check(all(a.shape == b.shape and torch.equal(a, b)
                         for a, b in zip(got, eager, strict=True)),
                     f"{name}: compiled call {attempt + 1} differs from eager")


@pytest.mark.mpi(ranks=2)
@pytest.mark.minimum_versions
def test_fallback_tensor_ops(checks):
    """fastreduce.ops.allreduce / allreduce_ under torch.compile without fullgraph."""
    def tensor_ops(x):
        y = fastreduce.ops.allreduce(x * 2, "max")
        z = x + 1
        fastreduce.ops.allreduce_(z, "sum")
        return y + z

    x = ints(60 + rank, 8)
    want = fastreduce.allreduce(x * 2, "max") + fastreduce.allreduce(x + 1, "sum")
    got = torch.compile(tensor_ops)(x)
    checks.check(torch.equal(got, want), f"tensor ops compiled: {got} want {want}")
