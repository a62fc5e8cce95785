"""fastreduce.distdl: DistDL's partition and AllSumReduce API over fastreduce's own classes.

On 13 ranks (12 workers, one sitting out), DistDL's AllSumReduce tests written against
fastreduce.distdl only (a port check): DistDL's test_all_sum_reduce_adjoint, its 9 cases
(partition shapes and reduced axes) with DistDL's structure (a communicator split to the
workers needed, MPIPartition over it, create_partition_inclusive,
create_cartesian_topology_partition, AllSumReduce(P_x, axes_reduce), zero_volume_tensor, y =
F x, dx = F* dy by backward, the dot-product test, then deactivate() of every partition).
The inputs are random (uniform, so the inner products are not near zero) with a seed per
case and worker; y and dx are also checked against sums rebuilt from the partners' seeds,
and the dot-product test must fail for an operator that is not the adjoint. Then DistDL's
examples/primitives/ex_all_reduce.py on 6 of the workers, with the values its comments give.

On 3 and 4 ranks (grids 1x3 and 2x2), DistDL's partition conventions and names.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import fastreduce
from fastreduce.distdl import (
    AllSumReduce,
    MPICartesianPartition,
    MPIPartition,
    zero_volume_tensor,
)

pytestmark = pytest.mark.one_mpi  # Python above the core: one MPI family's pass

WORLD = MPI.COMM_WORLD
p, rank = WORLD.size, WORLD.rank
device = torch.device("cpu")

# --- DistDL's AllSumReduce adjoint tests, on 12 of 13 ranks --------------------------------

# (P_x ranks, P_x shape, x local shape, axes_reduce): DistDL's 9 cases
adjoint_parametrizations = [
    (np.arange(0, 12), [2, 2, 3], [3, 4], tuple(), "distributed-3D-0D_reduction"),
    (np.arange(0, 12), [2, 2, 3], [3, 4], (0,), "distributed-3D-1D_reduction-0"),
    (np.arange(0, 12), [2, 2, 3], [3, 4], (1,), "distributed-3D-1D_reduction-1"),
    (np.arange(0, 12), [2, 2, 3], [3, 4], (2,), "distributed-3D-1D_reduction-2"),
    (np.arange(0, 12), [2, 2, 3], [3, 4], (0, 1), "distributed-3D-2D_reduction-01"),
    (np.arange(0, 12), [2, 2, 3], [3, 4], (0, 2), "distributed-3D-2D_reduction-02"),
    (np.arange(0, 12), [2, 2, 3], [3, 4], (1, 2), "distributed-3D-2D_reduction-12"),
    (np.arange(0, 12), [2, 2, 3], [3, 4], (0, 1, 2), "distributed-3D-3D_reduction"),
    (np.arange(0, 12), [12], [30, 344], (0,), "distributed-mock_weight_reduction"),
]


def comm_split(min_size):
    """DistDL's comm_split_fixture: the first min_size workers, and whether this is one."""
    active = WORLD.rank < min_size
    return WORLD.Split(0 if active else 1), active


def dot_product_test(P, x, dx, y, dy):
    """|<F x, dy> - <x, F* dy>| / max(|F x| |dy|, |x| |F* dy|), summed over P (float64)."""
    local = np.array([
        float(torch.sum(x.double() ** 2)), float(torch.sum(dx.double() ** 2)),
        float(torch.sum(y.double() ** 2)), float(torch.sum(dy.double() ** 2)),
        float(torch.sum(x.double() * dx.double())), float(torch.sum(y.double() * dy.double())),
    ])
    total = np.zeros_like(local)
    P.comm.Allreduce(local, total, op=MPI.SUM)
    norm_x, norm_dx, norm_y, norm_dy = np.sqrt(total[:4])
    ipx, ipy = total[4:]
    d = max(norm_y * norm_dy, norm_x * norm_dx)
    return ipx / d, ipy / d, abs(ipx - ipy) / d


def seeded(case, rank, what, shape):
    g = torch.Generator().manual_seed(10_000 * case + 100 * rank + what)
    return torch.rand(*shape, generator=g)


@pytest.mark.mpi(ranks=13)  # 12 workers, one rank sitting out (DistDL's conftest does so)
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("case", "params"), list(enumerate(adjoint_parametrizations)),
                         ids=[params[-1] for params in adjoint_parametrizations])
def test_all_sum_reduce_adjoint(checks, case, params):
    """DistDL's test_all_sum_reduce_adjoint (run on 12 ranks, or more: the extra ranks sit
    out, as in DistDL's conftest)."""
    P_x_ranks, P_x_shape, x_local_shape, axes_reduce, name = params
    WORLD.Barrier()
    base_comm, active = comm_split(12)
    if active:
        P_world = MPIPartition(base_comm)

        # Create the partitions
        P_x_base = P_world.create_partition_inclusive(P_x_ranks)
        P_x = P_x_base.create_cartesian_topology_partition(P_x_shape)

        layer = AllSumReduce(P_x, axes_reduce)
        layer = layer.to(device)

        x = zero_volume_tensor(device=device)
        if P_x.active:
            x = seeded(case, P_x.rank, 0, x_local_shape).to(device)
        x.requires_grad = True

        dy = zero_volume_tensor(device=device)
        if P_x.active:
            # Adjoint Input
            dy = seeded(case, P_x.rank, 1, x_local_shape).to(device)

        # y = F @ x
        y = layer(x)

        # dx = F* @ dy
        y.backward(dy)
        dx = x.grad

        x = x.detach()
        dx = dx.detach()
        dy = dy.detach()
        y = y.detach()

        checks.check(layer.P_x is P_x
                     and tuple(layer.axes_reduce) == tuple(sorted(axes_reduce)),
                     f"{name}: layer attributes")
        checks.check(tuple(layer.axes_keep)
                     == tuple(a for a in range(len(P_x_shape)) if a not in axes_reduce),
                     f"{name}: axes_keep {layer.axes_keep}")
        if P_x.active:
            # y and dx against the sums of the partners' inputs, rebuilt from their seeds
            grid = [np.unravel_index(r, P_x_shape) for r in range(len(P_x_ranks))]
            mine = grid[P_x.rank]
            partners = [r for r, c in enumerate(grid)
                        if all(c[k] == mine[k] for k in range(len(P_x_shape))
                               if k not in axes_reduce)]
            want = int(np.prod([P_x_shape[k] for k in axes_reduce]))
            checks.check(len(partners) == want, f"{name}: {len(partners)} partners")
            checks.check(layer.identity == (want == 1), f"{name}: identity {layer.identity}")
            for got, what in ((y, 0), (dx, 1)):
                parts = [seeded(case, r, what, x_local_shape).double().numpy()
                         for r in partners]
                ref = np.sum(parts, axis=0)
                err = float(np.max(np.abs(got.double().numpy() - ref)))
                bound = len(parts) * 2.0**-23 * float(np.max(np.sum(np.abs(parts), axis=0)))
                checks.check(got.shape == tuple(x_local_shape) and err <= bound,
                             f"{name}: {'y' if what == 0 else 'dx'} off by {err} "
                             f"(bound {bound})")

        ipx, ipy, residual = dot_product_test(P_world, x, dx, y, dy)
        checks.check(residual <= 1e-6, f"{name}: adjoint residual {residual}")
        # the test can fail: an operator that is not the adjoint must not pass it
        _, _, wrong = dot_product_test(P_world, x, dx * (1 + 1e-3), y, dy)
        checks.check(wrong > 1e-5, f"{name}: a wrong adjoint passed ({wrong})")

        P_world.deactivate()
        P_x_base.deactivate()
        P_x.deactivate()
        checks.check(not P_x.active and P_x.rank == MPI.PROC_NULL and P_x.size == -1
                     and layer.comm == MPI.COMM_NULL, f"{name}: deactivate()")
    base_comm.Free()
    WORLD.Barrier()


# --- DistDL's examples/primitives/ex_all_reduce.py (6 workers), its values checked ---------


def compute_subshape(P_shape, P_index, global_shape):
    """DistDL's balanced decomposition: the first (n % p) workers get one more."""
    return np.array([n // p + (1 if i < n % p else 0)
                     for p, i, n in zip(P_shape, P_index, global_shape, strict=True)])


def rank_filled(P_x, x_global_shape):
    """The example's input: this worker's block of x_global_shape, filled with rank + 1 (a
    zero-volume tensor on inactive workers), requiring grad."""
    x = zero_volume_tensor()
    if P_x.active:
        x_local_shape = compute_subshape(P_x.shape, P_x.index, x_global_shape)
        x = torch.from_numpy(np.zeros(x_local_shape) + P_x.rank + 1)
    x.requires_grad = True
    return x


def ex_all_reduce(checks, P_world):
    P_world._comm.Barrier()

    # Create the input/output partition (using all 6 workers)
    in_shape = (2, 3)
    in_size = np.prod(in_shape)
    in_workers = np.arange(0, in_size)

    P_x_base = P_world.create_partition_inclusive(in_workers)
    P_x = P_x_base.create_cartesian_topology_partition(in_shape)

    x = rank_filled(P_x, np.array([6, 6]))
    row, col = P_x.index
    checks.check(x.shape == (3, 2), f"example: x shape {x.shape}")

    def expect(y, value, what):
        checks.check(y.shape == x.shape and bool(torch.all(y == value)),
                     f"example {what}: worker {P_x.index} has {y.tolist()}, expected {value}")

    # Here we reduce the columns (axis 1), along the rows.
    all_reduce_cols = AllSumReduce(P_x, axes_reduce=(1,))
    expect(all_reduce_cols(x), [6, 15][row], "axes_reduce=(1,)")
    expect(AllSumReduce(P_x, axes_keep=(0,))(x), [6, 15][row], "axes_keep=(0,)")

    # Here we reduce the rows (axis 0), along the columns.
    all_reduce_rows = AllSumReduce(P_x, axes_reduce=(0,))
    y = all_reduce_rows(x)
    expect(y, [5, 7, 9][col], "axes_reduce=(0,)")
    y.backward(torch.ones_like(y))  # the adjoint sums the gradient the same way: 2 workers
    expect(x.grad, 2, "backward of axes_reduce=(0,)")

    # Here we reduce all axes.
    all_reduce_all = AllSumReduce(P_x, axes_reduce=(0, 1))
    expect(all_reduce_all(x), 21, "axes_reduce=(0, 1)")

    # Here we reduce none of the axes.
    all_reduce_none = AllSumReduce(P_x, axes_reduce=tuple())
    expect(all_reduce_none(x), P_x.rank + 1, "axes_reduce=()")

    # Unequal shapes along the reduced axis: reduce locally first, then all-reduce.
    x = rank_filled(P_x, np.array([5, 7]))
    checks.check(x.shape == ([3, 2][row], [3, 2, 2][col]), f"example: x shape {x.shape}")

    x_prime = torch.sum(x, (1,), keepdim=True)
    checks.check(bool(torch.all(x_prime == [[3, 4, 6], [12, 10, 12]][row][col])),
                 f"example: x_prime {x_prime.tolist()}")
    y = all_reduce_cols(x_prime)
    checks.check(y.shape == ([3, 2][row], 1) and bool(torch.all(y == [13, 34][row])),
                 f"example: worker {P_x.index} has {y.tolist()}, expected {[13, 34][row]}")

    P_x.deactivate()
    P_x_base.deactivate()


@pytest.mark.mpi(ranks=13)
@pytest.mark.timeout(600)
def test_ex_all_reduce(checks):
    """DistDL's examples/primitives/ex_all_reduce.py on the first 6 workers."""
    WORLD.Barrier()
    base_comm, active = comm_split(6)
    if active:
        ex_all_reduce(checks, MPIPartition(base_comm))
    base_comm.Free()


# --- DistDL's partition conventions and names, on 3 and 4 ranks ----------------------------

def api(case):
    """A case of the API on 3 and 4 ranks (grids 1x3 and 2x2), in the quick pass too."""
    return pytest.mark.minimum_versions(pytest.mark.mpi(ranks=(3, 4))(case))


rows = 2 if p % 2 == 0 else 1
cols = p // rows
coords = np.unravel_index(rank, (rows, cols))


@pytest.fixture(scope="module")
def world():
    """MPIPartition(COMM_WORLD)."""
    return MPIPartition(MPI.COMM_WORLD)


@pytest.fixture(scope="module")
def P(world):
    """A 2-d grid over every rank; deactivated at the end."""
    P = world.create_cartesian_topology_partition([rows, cols])
    yield P
    P.deactivate()


@pytest.fixture(scope="module")
def ring(world):
    """The same grid, periodic along axis 1; deactivated at the end."""
    ring = world.create_cartesian_topology_partition([rows, cols], periods=[False, True])
    yield ring
    ring.deactivate()


def layer_input():
    """Rank-seeded float64 (4, 3) values."""
    return torch.rand(4, 3, generator=torch.Generator().manual_seed(500 + rank),
                      dtype=torch.float64)


@api
def test_inactive_placeholder(checks):
    """MPIPartition(): DistDL's values."""
    check = checks.check
    empty = MPIPartition()
    check(not empty.active and empty.rank == MPI.PROC_NULL and empty.size == -1
          and empty.comm == MPI.COMM_NULL and empty.index is None, "MPIPartition() is inactive")
    check(isinstance(empty.shape, np.ndarray) and list(empty.shape) == [-1] and empty.dim == 1,
          f"inactive shape {empty.shape}")
    check(empty != empty and empty != MPIPartition(), "an inactive partition equals nothing")


@api
def test_world_partition(checks, world):
    check = checks.check
    check(world.active and world.rank == rank and world.size == p and world.index == rank,
          "MPIPartition(COMM_WORLD)")
    check(world._comm is world.comm and MPI.Comm.Compare(world.comm, WORLD) == MPI.IDENT,
          "comm and DistDL's _comm")
    check(world == MPIPartition(MPI.COMM_WORLD) and world != MPIPartition(),
          "== over one communicator")
    check({world: 1}.get(MPIPartition(MPI.COMM_WORLD)) == 1, "equal partitions hash alike")
    check(isinstance(world.native, fastreduce.Partition), "native partition")


@api
def test_zero_volume_tensor(checks):
    """DistDL's order of arguments: (b, dtype, requires_grad, device)."""
    check = checks.check
    t = zero_volume_tensor(None, torch.float64, True)
    check(t.shape == (0,) and t.dtype == torch.float64 and t.requires_grad,
          "zvt(None, f64, True)")
    t = zero_volume_tensor(3, None, False, torch.device("meta"))
    check(t.shape == (3, 0) and t.device.type == "meta" and not t.requires_grad
          and t.dtype == torch.get_default_dtype(), f"zvt(3, None, False, meta): {t}")


@api
def test_cartesian_partition(checks, P):
    """A 2-d grid over every rank: shape and index are numpy arrays."""
    check = checks.check
    check(isinstance(P, MPICartesianPartition) and P.dim == 2 and P.size == p, "Cartesian")
    check(isinstance(P.shape, np.ndarray) and np.array_equal(P.shape * 2, [2 * rows, 2 * cols])
          and bool(np.all(P.shape == [rows, cols])), f"shape {P.shape} is not a numpy array")
    check(isinstance(P.index, np.ndarray) and list(P.index) == list(coords), f"index {P.index}")
    check(all(list(P.cartesian_index(r)) == list(np.unravel_index(r, (rows, cols)))
              for r in range(p)), "cartesian_index")
    check(P.native.shape == (rows, cols), "the native partition keeps tuples")
    checks.expect(ValueError, ["rank", str(p)], lambda: P.cartesian_index(p))


def neighbours(index, shape, periods):
    out = []
    for axis in range(len(shape)):
        pair = []
        for step in (-1, 1):
            c = list(index)
            c[axis] += step
            if not 0 <= c[axis] < shape[axis]:
                if not periods[axis]:
                    pair.append(MPI.PROC_NULL)
                    continue
                c[axis] %= shape[axis]
            pair.append(int(np.ravel_multi_index(c, shape)))
        out.append(tuple(pair))
    return out


@api
def test_neighbor_ranks(checks, P, ring):
    check = checks.check
    check(all(P.neighbor_ranks(r) == neighbours(np.unravel_index(r, (rows, cols)),
                                                (rows, cols), (False, False))
              for r in range(p)),
          f"neighbor_ranks {P.neighbor_ranks(rank)}")
    check(ring.neighbor_ranks(rank) == neighbours(coords, (rows, cols), (False, True)),
          f"periodic neighbor_ranks {ring.neighbor_ranks(rank)}")


@api
def test_equality(checks, world, P, ring):
    """==: same communicator and rank."""
    checks.check(P == P and P == MPIPartition(P.comm) and P != world and P != ring,
                 "== of partitions")


@api
def test_reorder(checks, world, P):
    """reorder= is accepted (MPI may reorder; fastreduce keeps every rank's place)."""
    R = world.create_cartesian_topology_partition(np.array([rows, cols]), reorder=True)
    checks.check(R.active and list(R.index) == list(coords) and R != P, "reorder=True")
    checks.expect(TypeError, ["unexpected keyword"],
                  lambda: world.create_cartesian_topology_partition([p], colour=1))
    R.deactivate()


@api
@pytest.mark.parametrize("axes", [(), (0,), (1,), (0, 1)],
                         ids=["no-axes", "axis0", "axis1", "axes01"])
def test_allreduction_partition(checks, P, axes):
    """create_allreduction_partition(axes_reduce): the workers sharing the other
    coordinates."""
    check = checks.check
    A = P.create_allreduction_partition(axes)
    want_shape = [rows if 0 in axes else 1, cols if 1 in axes else 1]
    members = [r for r in range(p) if all(np.unravel_index(r, (rows, cols))[k] == coords[k]
                                          for k in range(2) if k not in axes)]
    got = A.comm.allgather(rank) if A.active else None
    check(isinstance(A, MPICartesianPartition) and list(A.shape) == want_shape
          and A.size == len(members) and got == members,
          f"create_allreduction_partition({axes}): shape {A.shape}, members {got}")
    check(list(A.index) == [coords[k] if k in axes else 0 for k in range(2)],
          f"create_allreduction_partition({axes}): index {A.index}")
    A.deactivate()
    check(not A.active and A.comm == MPI.COMM_NULL and A.rank == MPI.PROC_NULL
          and A.size == -1 and list(A.shape) == want_shape and A.index is None,
          f"deactivate() of the all-reduction partition {axes}")


@api
def test_allreduction_partition_bad_axes(checks, P):
    checks.expect(ValueError, ["axes_reduce", "out of range"],
                  lambda: P.create_allreduction_partition([2]))


@api
def test_subtopology(checks, P):
    """Sub-topologies: the cached sub-communicator; deactivating one leaves the parent
    alone."""
    check = checks.check
    S = P.create_cartesian_subtopology_partition([False, True])
    check(list(S.shape) == [cols] and S.size == cols and list(S.index) == [coords[1]],
          f"subtopology {S.shape} {S.index}")
    S_all = P.create_cartesian_subtopology_partition(np.array([True, True]))
    check(S_all == P and S_all is not P, "subtopology keeping every axis")
    S.deactivate()
    S_all.deactivate()
    check(P.active and P.comm != MPI.COMM_NULL and P.comm.allreduce(1) == p,
          "a deactivated sub-partition freed its parent's communicator")


@api
def test_all_sum_reduce(checks, P):
    """AllSumReduce: DistDL's attributes; the sum over each row. Where fastreduce is stricter
    or right, the compatibility layer is too: transposed inputs, bfloat16, and the
    (expanded, stride-0) gradient of y.sum()."""
    check, expect = checks.check, checks.expect
    layer = AllSumReduce(P, axes_reduce=(1,))
    check(layer.P_x is P and layer.axes_reduce == (1,) and layer.axes_keep == (0,)
          and layer.identity == (cols == 1), "AllSumReduce attributes")
    same = AllSumReduce(P, axes_keep=[0])
    check(same.axes_reduce == (1,) and same.axes_keep == (0,), "axes_keep=")
    expect(ValueError, ["exactly one"],
           lambda: AllSumReduce(P, axes_reduce=(1,), axes_keep=(0,)))
    expect(ValueError, ["exactly one"], lambda: AllSumReduce(P))
    x = layer_input()
    everyone = WORLD.allgather(x.numpy())
    want = sum(everyone[r] for r in range(p) if r // cols == coords[0])
    x.requires_grad = True
    y = layer(x)
    check(np.allclose(y.detach().numpy(), want, rtol=1e-14, atol=0), "AllSumReduce values")
    y.backward(torch.ones_like(y))
    check(bool(torch.all(x.grad == cols)), f"AllSumReduce backward {x.grad[0]}")
    xt = x.detach().t().clone().requires_grad_()
    yt = layer(xt.t())
    check(np.allclose(yt.detach().numpy(), want, rtol=1e-14, atol=0), "transposed input")
    yt.sum().backward()
    check(bool(torch.all(xt.grad == cols)), "the gradient of y.sum()")
    yb = layer(x.detach().bfloat16())
    check(yb.dtype == torch.bfloat16 and np.allclose(yb.float().numpy(), want,
                                                     rtol=2**-7 * cols),
          "bfloat16")


@api
def test_deactivate(checks, world):
    """deactivate() frees the partition's communicator and its cached sub-communicators."""
    D = world.create_cartesian_topology_partition([rows, cols])
    sub = AllSumReduce(D, axes_reduce=(1,)).comm
    checks.check(sub != MPI.COMM_NULL, "the layer's sub-communicator")
    D.deactivate()
    checks.check(sub == MPI.COMM_NULL and not D.active and D.rank == MPI.PROC_NULL
                 and D.size == -1 and list(D.shape) == [rows, cols] and D.index is None,
                 "deactivate() of a Cartesian")


@api
def test_workers_outside_a_partition(checks, world):
    """Workers outside a partition: inactive values; fastreduce asks for a zero-volume
    tensor."""
    check, expect = checks.check, checks.expect
    first = world.create_partition_inclusive([0])
    P0 = first.create_cartesian_topology_partition([1])
    layer0 = AllSumReduce(P0, axes_reduce=(0,))
    if rank == 0:
        x = layer_input().requires_grad_(True)
        check(P0.active and layer0.identity and list(P0.index) == [0], "1-worker partition")
        y0 = layer0(x)
        check(torch.equal(y0, x) and y0 is not x, "identity layer returns a copy")
    else:
        check(not first.active and first.rank == MPI.PROC_NULL and first.size == -1,
              "inactive inclusive partition")
        check(not P0.active and list(P0.shape) == [1] and P0.index is None
              and not layer0.identity, "inactive Cartesian partition")
        check(not P0.create_allreduction_partition((0,)).active,
              "inactive all-reduction partition")
        expect(ValueError, ["not in it"], lambda: P0.cartesian_index(0))
        z = zero_volume_tensor(requires_grad=True)
        check(layer0(z).numel() == 0, "an inactive worker's result")
        expect(ValueError, ["zero-volume"], lambda: layer0(torch.ones(2)))
    for part in (P0, first):
        part.deactivate()
