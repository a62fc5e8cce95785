"""torch's functional collectives (what DTensor and tensor-parallel code compile to) on the
fastreduce backend: eager and under torch.compile(fullgraph=True), no graph break."""

import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from common import Failures

import fastreduce.distributed  # noqa: F401  (registers the backend)

f = Failures()
dist.init_process_group("fastreduce")
rank, size = dist.get_rank(), dist.get_world_size()
group = dist.group.WORLD
x = torch.arange(4, dtype=torch.float64) + rank
total = sum(torch.arange(4, dtype=torch.float64) + r for r in range(size))

y = fc.wait_tensor(fc.all_reduce(x, "sum", group))
f.check(torch.equal(y, total), f"eager functional all_reduce {y}")
g = fc.wait_tensor(fc.all_gather_tensor(x, 0, group))
f.check(torch.equal(g, torch.cat([torch.arange(4, dtype=torch.float64) + r
                                  for r in range(size)])), f"eager all_gather_tensor {g}")


def fn(t):
    return fc.all_reduce(t * 2, "sum", group) + 1


f.check(torch._dynamo.explain(fn)(x).graph_break_count == 0, "graph breaks")
got = torch.compile(fn, fullgraph=True)(x)
f.check(torch.equal(got, 2 * total + 1), f"compiled functional all_reduce {got}")
dist.destroy_process_group()
f.finish()
