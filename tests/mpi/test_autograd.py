"""AllSumReduce and AllReduce (fastreduce.nn): values, adjoint (dot-product) tests, gradcheck,
5000 layers, bad input."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import fastreduce
from fastreduce.nn import AllReduce, AllSumReduce

pytestmark = [pytest.mark.mpi(ranks=(1, 2, 3, 4)), pytest.mark.across_nodes,
              pytest.mark.minimum_versions]

WORLD = MPI.COMM_WORLD
p, rank = WORLD.size, WORLD.rank
rows = 2 if p % 2 == 0 else 1
cols = p // rows


@pytest.fixture(scope="module")
def P():
    """A rows x cols grid over every rank (2 rows where the size is even)."""
    return fastreduce.Partition().create_cartesian_topology_partition([rows, cols])


@pytest.fixture(scope="module")
def row_ranks(P):
    """The ranks in this rank's row of P (its axis-1 reduction group)."""
    return [r for r in range(p) if r // cols == P.rank // cols]


def world_sum(value: float) -> float:
    return WORLD.allreduce(float(value))


def seeded(seed, *shape, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


# --- values --------------------------------------------------------------------------------
def test_all_sum_reduce_values(checks, P, row_ranks):
    layer = AllSumReduce(P, axes_reduce=[1])
    x = seeded(100 + rank, 4, 3)
    y = layer(x)
    want = sum(seeded(100 + r, 4, 3) for r in row_ranks)
    checks.check(torch.allclose(y, want, rtol=0, atol=1e-12), "AllSumReduce row sum")
    checks.check(torch.equal(AllSumReduce(P, axes_keep=[0])(x), y), "axes_keep == axes_reduce")
    checks.check(torch.equal(fastreduce.all_sum_reduce(x, P, [1]), y), "functional form")
    xt = seeded(7 + rank, 3, 4).T  # non-contiguous: made contiguous by the layer
    checks.check(torch.allclose(layer(xt), sum(seeded(7 + r, 3, 4).T for r in row_ranks),
                                rtol=0, atol=1e-12), "non-contiguous input")
    ident = AllSumReduce(P, axes_reduce=[])(x)
    checks.check(ident is not x and torch.equal(ident, x), "no axes: a clone")
    with torch.no_grad():
        xg = seeded(5, 3, requires_grad=True)
        yg = layer(xg)
    checks.check(not yg.requires_grad, "no_grad path records no graph")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.complex64], ids=lambda d: str(d)[6:])
def test_all_sum_reduce_dtype(checks, P, row_ranks, dtype):
    layer = AllSumReduce(P, axes_reduce=[1])
    xd = torch.full((5,), float(rank + 1)).to(dtype)
    yd = layer(xd)
    checks.check(yd.dtype == dtype and torch.equal(yd, torch.full((5,), float(sum(
        r + 1 for r in row_ranks))).to(dtype)), f"AllSumReduce {dtype}")


# --- adjoint (dot-product) tests: <F x, y> == <x, F* y> summed over ranks -------------------
def adjoint_gap(F, shape):
    x = seeded(1000 + rank, *shape, requires_grad=True)
    y = seeded(2000 + rank, *shape)
    Fx = F(x)
    (Fstar_y,) = torch.autograd.grad(Fx, x, grad_outputs=y)
    left = world_sum((Fx.detach() * y).sum())
    right = world_sum((x.detach() * Fstar_y).sum())
    return abs(left - right) / max(abs(left), abs(right), 1e-300)


@pytest.mark.parametrize("axes", [[0], [1], [0, 1], []],
                         ids=["axis0", "axis1", "axes01", "no-axes"])
def test_all_sum_reduce_adjoint(checks, P, axes):
    gap = adjoint_gap(AllSumReduce(P, axes_reduce=axes), (6, 5))
    checks.check(gap <= 1e-12, f"AllSumReduce{axes} adjoint gap {gap:.2e}")


def test_all_reduce_sum_backward_adjoint(checks):
    gap = adjoint_gap(AllReduce(backward="sum"), (7,))
    checks.check(gap <= 1e-12, f"AllReduce(backward='sum') adjoint gap {gap:.2e}")


def test_all_reduce(checks):
    """AllReduce's default backward is the identity (Megatron's "g"); avg; a group of one."""
    x = seeded(3 + rank, 4, requires_grad=True)
    g = seeded(4 + rank, 4)
    out = AllReduce()(x)
    checks.check(torch.allclose(out, sum(seeded(3 + r, 4) for r in range(p)), atol=1e-12),
                 "AllReduce")
    (gx,) = torch.autograd.grad(out, x, grad_outputs=g)
    checks.check(torch.equal(gx, g), "identity backward")
    avg = AllReduce(op="avg")(seeded(3 + rank, 4))
    checks.check(torch.allclose(avg, sum(seeded(3 + r, 4) for r in range(p)) / p, atol=1e-12),
                 "avg")
    single = AllReduce(comm=MPI.COMM_SELF)
    checks.check(single(x) is x, "a group of one is a no-op")


# --- gradcheck of a composed model ----------------------------------------------------------
def test_gradcheck_of_a_composed_model(checks):
    """gradcheck runs in lockstep: every rank perturbs the same input element at once. With
    the same weights everywhere and inputs that depend only on the column coordinate, every
    row sum and everything after it is the same on all ranks, so the numerical Jacobian
    (cols * p * H W1) equals the analytical one only if each backward is its forward's
    adjoint (an identity backward of the row sum would give p * H W1)."""
    G = fastreduce.Partition().create_cartesian_topology_partition(
        [2, p // 2] if p >= 4 and p % 2 == 0 else [1, p])
    torch.manual_seed(0)
    W1 = torch.randn(5, 4, dtype=torch.float64)
    W2 = torch.randn(3, 5, dtype=torch.float64)
    sum_rows = AllSumReduce(G, axes_reduce=[1])
    tp = AllReduce(backward="sum")

    def model(x):
        return tp(torch.tanh(W2 @ torch.tanh(sum_rows(W1 @ x)))).sin()

    x = seeded(50 + G.coords[1], 4, 2, requires_grad=True)
    ok = torch.autograd.gradcheck(model, (x,), eps=1e-6, atol=1e-7, rtol=1e-5,
                                  raise_exception=False)
    checks.check(ok, f"gradcheck of the composed model on a {list(G.shape)} grid")


# --- many layers, one communicator ----------------------------------------------------------
def test_5000_layers_share_one_communicator(checks, P, row_ranks):
    before = dict(P._subs)
    layers = [AllSumReduce(P, axes_reduce=[1]) for _ in range(5000)]
    checks.check(all(lay.comm is layers[0].comm for lay in layers),
                 "layers share one communicator")
    checks.check(set(P._subs) == set(before) | {(1,)}, f"cache grew: {list(P._subs)}")
    x = torch.ones(3, requires_grad=True)
    total = x
    for lay in layers:
        total = lay(total) / len(row_ranks)
    total.sum().backward()
    checks.check(torch.allclose(total, torch.ones(3)) and torch.allclose(x.grad, torch.ones(3)),
                 f"5000 layers: {total} {x.grad}")


# --- bad input ------------------------------------------------------------------------------
def test_bad_input(checks, P):
    expect = checks.expect
    expect(ValueError, ["exactly one"], lambda: AllSumReduce(P))
    expect(ValueError, ["exactly one"], lambda: AllSumReduce(P, axes_reduce=[0], axes_keep=[1]))
    expect(ValueError, ["axes_reduce [5]", "out of range"],
           lambda: AllSumReduce(P, axes_reduce=[5]))
    expect(ValueError, ["axes_keep", "repeat"], lambda: AllSumReduce(P, axes_keep=[0, 0]))
    expect(TypeError, ["CartesianPartition"], lambda: AllSumReduce(fastreduce.Partition(), [0]))
    expect(ValueError, ["backward"], lambda: AllReduce(backward="adjoint"))
    expect(ValueError, ["op"], lambda: AllReduce(op="max"))
    inactive = fastreduce.Partition(MPI.COMM_NULL).create_cartesian_topology_partition([2])
    lazy = AllSumReduce(inactive, axes_reduce=[0])
    zv = fastreduce.zero_volume_tensor(requires_grad=True)
    out = lazy(zv)
    checks.check(out.shape == (0,) and out is not zv, "inactive worker: clone of zero volume")
    expect(ValueError, ["not in the partition", "zero-volume"], lambda: lazy(torch.ones(2)))
    checks.check(fastreduce.zero_volume_tensor(4, dtype=torch.float16).shape == (4, 0),
                 "zvt(b)")


@pytest.fixture
def consistency_checks():
    """fastreduce.autograd's consistency checks on for the case, then as they were."""
    from fastreduce.autograd import set_consistency_checks

    old = set_consistency_checks(True)
    yield
    set_consistency_checks(old)


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_consistency_checks(checks, P, consistency_checks):
    """With consistency checks on, ranks that pass different dtypes all get a ValueError
    (instead of a wrong sum or a hang); off, nothing extra is communicated."""
    expect = checks.expect
    mixed = torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64)
    expect(ValueError, ["different dtype or shape", "rank 0: torch.float32",
                        "rank 1: torch.float64"], lambda: AllReduce()(mixed))
    expect(ValueError, ["different dtype or shape"],
           lambda: fastreduce.all_sum_reduce(torch.ones(rank + 1), P, [0, 1]))
    checks.check(torch.equal(AllReduce()(torch.ones(2)), torch.full((2,), float(p))),
                 "consistent call with checks on")
