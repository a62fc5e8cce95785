"""torch's functional collectives (what DTensor and tensor-parallel code compile to) on the
fastreduce backend: eager and under torch.compile(fullgraph=True), no graph break."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import fastreduce.distributed  # noqa: F401  (registers the backend)

pytestmark = [pytest.mark.mpi(ranks=2), pytest.mark.one_mpi, pytest.mark.minimum_versions]


@pytest.fixture(scope="module")
def group():
    """The default group, on fastreduce; destroyed at the module's end."""
    dist.init_process_group("fastreduce")
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def x(group):
    return torch.arange(4, dtype=torch.float64) + dist.get_rank()


@pytest.fixture
def total(group):
    return sum(torch.arange(4, dtype=torch.float64) + r for r in range(dist.get_world_size()))


def test_eager_all_reduce(group, x, total, checks):
    y = fc.wait_tensor(fc.all_reduce(x, "sum", group))
    checks.check(torch.equal(y, total), f"eager functional all_reduce {y}")


def test_eager_all_gather_tensor(group, x, checks):
    g = fc.wait_tensor(fc.all_gather_tensor(x, 0, group))
    checks.check(torch.equal(g, torch.cat([torch.arange(4, dtype=torch.float64) + r
                                           for r in range(dist.get_world_size())])),
                 f"eager all_gather_tensor {g}")


def test_compiled_all_reduce_without_graph_breaks(group, x, total, checks):
    """torch._dynamo.explain finds no graph break; the compiled function (fullgraph) gives
    eager's answer."""
    def fn(t):
        return fc.all_reduce(t * 2, "sum", group) + 1

    checks.check(torch._dynamo.explain(fn)(x).graph_break_count == 0, "graph breaks")
    got = torch.compile(fn, fullgraph=True)(x)
    checks.check(torch.equal(got, 2 * total + 1), f"compiled functional all_reduce {got}")
