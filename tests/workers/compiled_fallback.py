"""torch.compile without fullgraph over fastreduce's layers and ops gives eager's results on
every torch: traced through the custom ops where fastreduce.ops.TRACEABLE (torch 2.12 and
newer), run eagerly with graph breaks around them on older torch."""

from __future__ import annotations

import torch
import torch._dynamo
from common import WORLD, Failures

import fastreduce
import fastreduce.ops
from fastreduce.nn import AllReduce, AllSumReduce

f = Failures()
p, rank = WORLD.size, WORLD.rank
P = fastreduce.Partition().create_cartesian_topology_partition([1, p])


def ints(seed, *shape):
    """Integer-valued float64: sums are exact, whatever the order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).to(torch.float64)


class Block(torch.nn.Module):
    def __init__(self, reduce):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6, dtype=torch.float64)
        with torch.no_grad():
            self.lin.weight.copy_(ints(3, 6, 6))
            self.lin.bias.copy_(ints(4, 6))
        self.reduce = reduce

    def forward(self, x):
        return self.lin(self.reduce(self.lin(x)) * 2)


def run(model, x):
    x = x.detach().clone().requires_grad_(True)
    for q in model.parameters():
        q.grad = None
    y = model(x)
    (y * ints(50 + rank, *y.shape)).sum().backward()
    return [y.detach(), x.grad, *[q.grad.clone() for q in model.parameters()]]


LAYERS = {
    "AllSumReduce": lambda: AllSumReduce(P, axes_reduce=[1]),
    "AllReduce identity": lambda: AllReduce(op="sum", backward="identity"),
    "AllReduce sum": lambda: AllReduce(op="sum", backward="sum"),
    "all_sum_reduce": lambda: (lambda x: fastreduce.all_sum_reduce(x, P, [1])),
    "all_reduce": lambda: (lambda x: fastreduce.all_reduce(x, None, "sum", "sum")),
}

for name, make in LAYERS.items():
    model = Block(make())
    x = ints(10 + rank, 5, 6)
    eager = run(model, x)
    compiled = torch.compile(model)
    for attempt in range(2):
        got = run(compiled, x)
        f.check(all(a.shape == b.shape and torch.equal(a, b)
                    for a, b in zip(got, eager, strict=True)),
                f"{name}: compiled call {attempt + 1} differs from eager")


def tensor_ops(x):
    y = fastreduce.ops.allreduce(x * 2, "max")
    z = x + 1
    fastreduce.ops.allreduce_(z, "sum")
    return y + z


x = ints(60 + rank, 8)
want = fastreduce.allreduce(x * 2, "max") + fastreduce.allreduce(x + 1, "sum")
got = torch.compile(tensor_ops)(x)
f.check(torch.equal(got, want), f"tensor ops compiled: {got} want {want}")
if WORLD.rank == 0:
    print(f"torch {torch.__version__}: traced through the custom ops: "
          f"{fastreduce.ops.TRACEABLE}", flush=True)
f.finish()
