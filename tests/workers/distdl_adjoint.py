"""DistDL's AllSumReduce tests, written against fastreduce.distdl only: a port check.

Part 1 is DistDL's test_all_sum_reduce_adjoint: its 9 cases (partition shapes and
reduced axes) on 12 workers, each with DistDL's structure (a communicator split
to the workers needed, MPIPartition over it, create_partition_inclusive,
create_cartesian_topology_partition, AllSumReduce(P_x, axes_reduce),
zero_volume_tensor, y = F x, dx = F* dy by backward, the dot-product test, then
deactivate() of every partition). The inputs are random (uniform, so the inner
products are not near zero) with a seed per case and worker; y and dx are also
checked against sums rebuilt from the partners' seeds, and the dot-product test
must fail for an operator that is not the adjoint.

Part 2 is DistDL's examples/primitives/ex_all_reduce.py on 6 of the workers,
with the values its comments give.

Run on 12 ranks (or more: the extra ranks sit out, as in DistDL's conftest).
"""

from __future__ import annotations

import numpy as np
import torch
from common import WORLD, Failures
from mpi4py import MPI

from fastreduce.distdl import AllSumReduce, MPIPartition, zero_volume_tensor

fails = Failures()
device = torch.device("cpu")

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


def test_all_sum_reduce_adjoint(case, P_x_ranks, P_x_shape, x_local_shape, axes_reduce, name):
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

        fails.check(layer.P_x is P_x and tuple(layer.axes_reduce) == tuple(sorted(axes_reduce)),
                    f"{name}: layer attributes")
        fails.check(tuple(layer.axes_keep)
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
            fails.check(len(partners) == want, f"{name}: {len(partners)} partners")
            fails.check(layer.identity == (want == 1), f"{name}: identity {layer.identity}")
            for got, what in ((y, 0), (dx, 1)):
                parts = [seeded(case, r, what, x_local_shape).double().numpy() for r in partners]
                ref = np.sum(parts, axis=0)
                err = float(np.max(np.abs(got.double().numpy() - ref)))
                bound = len(parts) * 2.0**-23 * float(np.max(np.sum(np.abs(parts), axis=0)))
                fails.check(got.shape == tuple(x_local_shape) and err <= bound,
                            f"{name}: {'y' if what == 0 else 'dx'} off by {err} (bound {bound})")

        ipx, ipy, residual = dot_product_test(P_world, x, dx, y, dy)
        fails.check(residual <= 1e-6, f"{name}: adjoint residual {residual}")
        # the test can fail: an operator that is not the adjoint must not pass it
        _, _, wrong = dot_product_test(P_world, x, dx * (1 + 1e-3), y, dy)
        fails.check(wrong > 1e-5, f"{name}: a wrong adjoint passed ({wrong})")
        if P_world.rank == 0:
            print(f"{name}: Adjoint test: {ipx} {ipy} (residual {residual:.1e})", flush=True)

        P_world.deactivate()
        P_x_base.deactivate()
        P_x.deactivate()
        fails.check(not P_x.active and P_x.rank == MPI.PROC_NULL and P_x.size == -1
                    and layer.comm == MPI.COMM_NULL, f"{name}: deactivate()")
    base_comm.Free()
    WORLD.Barrier()


for case, params in enumerate(adjoint_parametrizations):
    test_all_sum_reduce_adjoint(case, *params)


# Part 2: examples/primitives/ex_all_reduce.py (6 workers), its values checked


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


def ex_all_reduce(P_world):
    P_world._comm.Barrier()

    # Create the input/output partition (using all 6 workers)
    in_shape = (2, 3)
    in_size = np.prod(in_shape)
    in_workers = np.arange(0, in_size)

    P_x_base = P_world.create_partition_inclusive(in_workers)
    P_x = P_x_base.create_cartesian_topology_partition(in_shape)

    x = rank_filled(P_x, np.array([6, 6]))
    row, col = P_x.index
    fails.check(x.shape == (3, 2), f"example: x shape {x.shape}")

    def expect(y, value, what):
        fails.check(y.shape == x.shape and bool(torch.all(y == value)),
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
    fails.check(x.shape == ([3, 2][row], [3, 2, 2][col]), f"example: x shape {x.shape}")

    x_prime = torch.sum(x, (1,), keepdim=True)
    fails.check(bool(torch.all(x_prime == [[3, 4, 6], [12, 10, 12]][row][col])),
                f"example: x_prime {x_prime.tolist()}")
    y = all_reduce_cols(x_prime)
    fails.check(y.shape == ([3, 2][row], 1) and bool(torch.all(y == [13, 34][row])),
                f"example: worker {P_x.index} has {y.tolist()}, expected {[13, 34][row]}")

    P_x.deactivate()
    P_x_base.deactivate()


WORLD.Barrier()
base_comm, active = comm_split(6)
if active:
    ex_all_reduce(MPIPartition(base_comm))
base_comm.Free()
fails.finish()
