"""fastreduce.horovod: DistributedOptimizer, the broadcast helpers and SyncBatchNorm against
single-process torch on the batches of all ranks (computed on every rank).

The `horovod` fixture starts Horovod once for this module, with a static process set of
every rank but the last, and shuts it down after the module's last case; float64 is
torch's default dtype meanwhile.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from mpi4py import MPI

import fastreduce.horovod as hvd

WORLD = MPI.COMM_WORLD
P, rank = WORLD.size, WORLD.rank


@pytest.fixture(scope="module", autouse=True)
def horovod():
    """hvd.init() with the process set of ranks 0..P-2 (none on one rank); the set, or
    None. hvd.shutdown() after the module's last case."""
    assert not hvd.is_initialized(), "a module before this one left Horovod initialized"
    subset = hvd.ProcessSet(list(range(P - 1))) if P > 1 else None
    hvd.init(process_sets=[subset] if subset is not None else None)
    yield subset
    hvd.shutdown()


@pytest.fixture(scope="module", autouse=True)
def float64_default():
    """torch's default dtype float64 for this module's cases (the one before it after)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


class Net(torch.nn.Module):
    """Three linear layers, a head used on even ranks only, and a parameter never used."""

    def __init__(self, dtype=torch.float64, width=8):
        super().__init__()
        self.a = torch.nn.Linear(5, width, dtype=dtype)
        self.b = torch.nn.Linear(width, width, dtype=dtype)
        self.c = torch.nn.Linear(width, 3, dtype=dtype)
        self.head = torch.nn.Linear(3, 3, dtype=dtype)
        self.unused = torch.nn.Linear(2, 2, dtype=dtype)

    def forward(self, x, r):
        x = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return self.head(x) if r % 2 == 0 else x


def batch(step, r, dtype=torch.float64, n=4):
    """Rank r's slice of step's global batch (the same numbers on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(n, 5, generator=g, dtype=dtype), torch.randn(n, 3, generator=g,
                                                                    dtype=dtype)


def loss_of(model, x, y, r):
    return (model(x, r) - y).square().mean()


def close(a, b, tol):
    return torch.allclose(a, b, rtol=tol, atol=tol)


def train(checks, what, make_opt, *, steps=2, passes=1, dtype=torch.float64, tol=1e-11,
          members=None, scale=None, clip=None, **kwargs):
    """Train a DistributedOptimizer on each rank's slices and a plain optimizer on the slices
    of `members` (default: all ranks; their losses averaged, or summed with op=Sum)."""
    members = list(range(P)) if members is None else members
    torch.manual_seed(7)
    model = Net(dtype)
    reference = Net(dtype)
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    ref_opt = make_opt(reference.parameters())
    weight = scale if scale is not None else 1.0 / len(members)
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for k in range(passes):
            x, y = batch(step * passes + k, rank, dtype)
            loss_of(model, x, y, rank).backward()
            total = sum(loss_of(reference, *batch(step * passes + k, r, dtype), r)
                        for r in members)
            (weight * total).backward()
        if clip is not None:  # clip the reduced gradients: synchronize() first
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with opt.skip_synchronize():
                    opt.step()
            checks.check(not caught, f"{what}: a warning under skip_synchronize: "
                                     f"{[str(w.message) for w in caught]}")
        else:
            opt.step()
        ref_opt.step()
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
            checks.check(close(a, b, tol), f"{what} step {step}: {name} differs by "
                                           f"{(a - b).abs().max().item():.3g}")
    return opt, model


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


# --- DistributedOptimizer training -----------------------------------------------------------
def test_sgd(checks):
    """The wrapper is an instance of the wrapped optimizer's class, and trains like it."""
    opt, _ = train(checks, "SGD", sgd)
    checks.check(isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD",
                  f"the wrapper is not an SGD: {type(opt).__mro__}")


# (what, optimizer, HOROVOD_FUSION_THRESHOLD or None, train()'s arguments)
TRAININGS = [
    pytest.param("Adam", adam, None, {}, id="adam"),
    pytest.param("Adam, a bucket per parameter", adam, "0", {}, id="adam-bucket-per-parameter"),
    pytest.param("SGD, 200-byte buckets", sgd, "200", {}, id="sgd-200-byte-buckets"),
    pytest.param("SGD, 2 passes per step", sgd, None, {"passes": 2}, id="sgd-2-passes"),
    pytest.param("Adam, 2 passes per step, small buckets", adam, "300", {"passes": 2},
                 id="adam-2-passes-small-buckets"),
    pytest.param("SGD, groups=2", sgd, None, {"groups": 2}, id="sgd-groups-2"),
    pytest.param("Adam, num_groups=3", adam, None, {"num_groups": 3}, id="adam-num-groups-3",
                 marks=pytest.mark.filterwarnings("ignore::DeprecationWarning")),
    pytest.param("SGD, predivide 4", sgd, None, {"gradient_predivide_factor": 4.0},
                 id="sgd-predivide-4"),
    pytest.param("Adam, predivide 2, 2 passes", adam, None,
                 {"passes": 2, "gradient_predivide_factor": 2.0}, id="adam-predivide-2-2-passes"),
    pytest.param("SGD, op=Sum", sgd, None, {"op": hvd.Sum, "scale": 1.0}, id="sgd-op-sum"),
    pytest.param("SGD, clipped after synchronize()", sgd, None, {"clip": 0.05},
                 id="sgd-clipped-after-synchronize"),
    pytest.param("SGD float32, fp16 compression", sgd, None,
                 {"dtype": torch.float32, "tol": 2e-3, "compression": hvd.Compression.fp16},
                 id="sgd-float32-fp16-compression"),
    pytest.param("SGD float64, fp16 compression (cast)", sgd, None,
                 {"tol": 2e-3, "compression": hvd.Compression.fp16},
                 id="sgd-float64-fp16-compression"),
]


@pytest.mark.parametrize("what, make_opt, fusion, kwargs", TRAININGS)
def test_training(checks, monkeypatch, what, make_opt, fusion, kwargs):
    """Two steps of DistributedOptimizer(make_opt) equal make_opt on every rank's batches."""
    if fusion is not None:
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", fusion)
    train(checks, what, make_opt, **kwargs)


@pytest.mark.parametrize("schedule", ["overlap", "serial", "serial-in-place", "serial-flat"])
def test_training_under_each_schedule(checks, monkeypatch, schedule):
    """Each gradient schedule, fixed, with a predivide factor and fp16 compression, trains
    like the wrapped optimizer (serial-in-place: every gradient reduced where it is;
    serial-flat: all of them in the flat buffer, one reduction)."""
    from fastreduce.torch import buckets  # noqa: PLC0415

    if schedule in ("serial-in-place", "serial-flat"):
        monkeypatch.setattr(buckets, "DIRECT_BYTES", 0)
        monkeypatch.setattr(buckets, "SERIAL_FORMS",
                            ("in place",) if schedule == "serial-in-place" else ("flat",))
    monkeypatch.setenv("FASTREDUCE_GRADIENT_SCHEDULE", schedule.split("-")[0])
    train(checks, f"SGD, predivide 2, fp16 compression, {schedule}", sgd,
          gradient_predivide_factor=2.0, compression=hvd.Compression.fp16, tol=2e-3,
          passes=2)


def test_explicit_groups(checks):
    """DistributedOptimizer(groups=[[...], [...]]): the listed parameters reduced together."""
    names = [n for n, _ in Net().named_parameters()]
    torch.manual_seed(7)
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    by_name = dict(zip(names, model.parameters(), strict=True))
    groups = [[by_name["a.weight"], by_name["c.bias"]], [by_name["b.weight"], by_name["b.bias"]]]
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters(), groups=groups)
    ref_opt = sgd(reference.parameters())
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss_of(model, *batch(step, rank), rank).backward()
        (sum(loss_of(reference, *batch(step, r), r) for r in range(P)) / P).backward()
        opt.step()
        ref_opt.step()
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
            checks.check(close(a, b, 1e-11), f"explicit groups step {step}: {name} differs")


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_training_over_a_process_set(checks, horovod):
    """Over the static set of ranks 0..P-2: its members average their batches; the last
    rank, outside it, trains alone."""
    members = horovod.ranks if horovod.included() else [rank]
    train(checks, "SGD over a process set", sgd, members=members, process_set=horovod)


@pytest.mark.parametrize("as_dense", [True, False], ids=["sparse-as-dense", "sparse"])
def test_sparse_training(checks, as_dense):
    torch.manual_seed(3)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    ref = torch.nn.Embedding(10, 4)
    ref.load_state_dict(emb.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=as_dense)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        ids = [torch.tensor([(3 * r + step) % 10, (r * r + 1) % 10]) for r in range(P)]
        opt.zero_grad()
        ref_opt.zero_grad()
        emb(ids[rank]).sum().backward()
        (sum(ref(i).sum() for i in ids) / P).backward()
        opt.step()
        ref_opt.step()
        checks.check(close(emb.weight, ref.weight, 1e-12),
                     f"sparse_as_dense={as_dense} step {step}: embedding differs by "
                     f"{(emb.weight - ref.weight).abs().max().item():.3g}")


# --- DistributedOptimizer errors -------------------------------------------------------------
def test_optimizer_errors(checks):
    torch.manual_seed(1)
    model = Net()
    params = list(model.named_parameters())
    expect = checks.expect
    expect(ValueError, ["unique", "a.weight"], lambda: hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=[params[0]] + params))
    expect(ValueError, ["not named"], lambda: hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=params[1:]))
    expect(ValueError, ["Adasum", "Average"], lambda: hvd.DistributedOptimizer(
        sgd(model.parameters()), op=hvd.Adasum))
    expect(ValueError, ["gradient_predivide_factor", "Average"],
           lambda: hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Sum,
                                            gradient_predivide_factor=2.0))
    expect(ValueError, ["groups"], lambda: hvd.DistributedOptimizer(
        sgd(model.parameters()), groups=[[params[0][1]], [params[0][1]]]))
    expect(ValueError, ["named_parameters", "tuples"], lambda: hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=[p for _, p in params]))

    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    x, y = batch(0, rank)
    loss_of(model, x, y, rank).backward()
    if P > 1:
        expect(AssertionError, ["zero_grad", "step"], opt.zero_grad)
        expect(AssertionError, ["backward_passes_per_step"],
               lambda: loss_of(model, x, y, rank).backward())
    opt.synchronize()
    reduced = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
               for p in model.parameters()]  # SGD leaves a parameter without a gradient
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # after synchronize(), outside skip_synchronize(): Horovod warns
    horovods = "optimizer.step() called without optimizer.skip_synchronize()"  # its wording
    checks.check(P == 1 or any(horovods in str(w.message) for w in caught),
                 f"no warning for step() after synchronize(): {caught}")
    # the step used the gradients synchronize() reduced (not zeros, not reduced twice)
    checks.check(all(torch.allclose(p.detach(), b - 0.1 * g) for p, b, g in
                     zip(model.parameters(), before, reduced, strict=True)) and
                 any(g.abs().sum() > 0 for g in reduced),
                 "step() after synchronize() did not apply the reduced gradients")
    opt.zero_grad()


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_parameters_differ(checks):
    """A rank whose parameters differ: every rank refuses, none waits."""
    torch.manual_seed(1)
    other = Net(width=8 if rank == 0 else 9)
    checks.expect_everywhere(lambda: hvd.DistributedOptimizer(
        sgd(other.parameters()), named_parameters=other.named_parameters()),
        ["DistributedOptimizer", "parameters"])


# --- broadcasts ------------------------------------------------------------------------------
def test_broadcast_parameters(checks):
    root = P - 1
    torch.manual_seed(50 + rank)
    model = Net()
    torch.manual_seed(50 + root)
    expected = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    for (name, a), b in zip(model.named_parameters(), expected.parameters(), strict=True):
        checks.check(torch.equal(a, b), f"broadcast_parameters(state_dict): {name}")
    torch.manual_seed(60 + rank)
    model = Net()
    torch.manual_seed(60)
    expected = Net()
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    for a, b in zip(model.parameters(), expected.parameters(), strict=True):
        checks.check(torch.equal(a, b), "broadcast_parameters(named_parameters)")


def stepped(make, r, steps):
    """An optimizer as rank r makes it: `steps` steps on r's batches."""
    torch.manual_seed(70)
    m = Net()
    o = make(m.parameters(), r)
    for s in range(steps):
        o.zero_grad()
        loss_of(m, *batch(s, r), r).backward()
        o.step()
    return o


MAKERS = {
    "Adam": lambda ps, r: torch.optim.Adam(ps, lr=0.01 * (r + 1), betas=(0.8, 0.9 + r / 100)),
    "SGD": lambda ps, r: torch.optim.SGD(ps, lr=0.1 * (r + 1), momentum=0.5),
}


@pytest.mark.parametrize("root_steps, my_steps", [(2, 0), (1, 3)], ids=["2-vs-0", "1-vs-3"])
@pytest.mark.parametrize("kind", MAKERS)
def test_broadcast_optimizer_state(checks, kind, root_steps, my_steps):
    """The last rank's optimizer state (after root_steps steps) replaces the others' (after
    my_steps); a wrapped optimizer (Adam here) works alike."""
    root, make = P - 1, MAKERS[kind]
    mine = stepped(make, rank, root_steps if rank == root else my_steps)
    if kind == "Adam":  # a wrapped optimizer works alike (wrapping is collective)
        mine = hvd.DistributedOptimizer(mine)
    hvd.broadcast_optimizer_state(mine, root_rank=root)
    want = stepped(make, root, root_steps).state_dict()
    got = mine.state_dict()
    what = f"broadcast_optimizer_state {kind} ({root_steps} vs {my_steps} steps)"
    checks.check(got["param_groups"] == want["param_groups"],
                 f"{what}: param_groups {got['param_groups']} != {want['param_groups']}")
    same = got["state"].keys() == want["state"].keys() and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(want["state"][i][k]))
        for i, s in got["state"].items() for k, v in s.items())
    checks.check(same, f"{what}: state differs")


def test_broadcast_state_of_a_fresh_optimizer(checks):
    """No step taken anywhere: as Horovod, every trained parameter gets a zero gradient
    and the optimizer its state from one local step (SGD with momentum: zero buffers); a
    parameter not trained keeps no gradient."""
    torch.manual_seed(71)
    m = Net()
    frozen = next(m.parameters())
    frozen.requires_grad_(False)
    before = [p.detach().clone() for p in m.parameters()]
    o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=m.named_parameters())
    hvd.broadcast_optimizer_state(o, root_rank=0)
    trained = [p for p in m.parameters() if p.requires_grad]
    checks.check(frozen.grad is None, "a frozen parameter got a gradient")
    checks.check(all(p.grad is not None and not p.grad.any() for p in trained),
                 "trained parameters have zero gradients")
    state = o.state_dict()["state"]
    checks.check(len(state) == len(trained) and all(
        not s["momentum_buffer"].any() for s in state.values()),
        f"momentum buffers made, zero: {state}")
    checks.check(all(torch.equal(a, b) for a, b in zip(m.parameters(), before, strict=True)),
                 "a step on zero gradients without weight decay moves nothing")


def test_broadcast_state_keeps_the_parameters_where_weights_decay(checks):
    """Only the root has optimizer state (it resumed from a checkpoint); AdamW decays
    weights: the step that makes the other ranks' state does not move their parameters, so
    after broadcast_parameters and broadcast_optimizer_state every rank holds the root's."""
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.5)
    if rank == 0:
        w.grad = torch.ones(3, dtype=torch.float64)
        opt.step()
    root = w.detach().clone() if rank == 0 else None
    hvd.broadcast_parameters([("w", w)], root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    root = WORLD.bcast(root, root=0)
    checks.check(torch.equal(w.detach(), root), f"parameters {w.tolist()}, root's {root.tolist()}")


def test_objects(checks):
    """broadcast_object (with the object everywhere, or None off the root) and
    allgather_object."""
    root = P - 1
    obj = {"rank": rank, "list": list(range(rank + 2)), "text": "x" * (5 * rank)}
    got = hvd.broadcast_object(obj, root_rank=root)
    checks.check(got == {"rank": root, "list": list(range(root + 2)), "text": "x" * (5 * root)},
                 f"broadcast_object gave {got}")
    got = hvd.broadcast_object(obj if rank == root else None, root_rank=root)
    checks.check(got == {"rank": root, "list": list(range(root + 2)), "text": "x" * (5 * root)},
                 f"broadcast_object with None elsewhere gave {got}")
    got = hvd.allgather_object(obj)
    checks.check(got == [{"rank": r, "list": list(range(r + 2)), "text": "x" * (5 * r)}
                         for r in range(P)], f"allgather_object gave {got}")
    checks.check(hvd.allgather_object(None) == [None] * P, "allgather_object(None)")


# --- SyncBatchNorm ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape, sizes, momentum", [
    pytest.param((3, 4), [r + 2 for r in range(P)], 0.1, id="NCL-momentum-0.1"),
    pytest.param((3,), [2 * r for r in range(P)] if P > 1 else [2], None,
                 id="NC-cumulative-uneven"),
])
def test_sync_batch_norm(checks, comm, shape, sizes, momentum):
    """Two training steps and eval mode against BatchNorm1d on the batches of all ranks."""
    total = sum(sizes)
    start = sum(sizes[:rank])
    g = torch.Generator().manual_seed(11)
    what = f"SyncBatchNorm {shape} sizes {sizes}"
    sbn = hvd.SyncBatchNorm(3, momentum=momentum)
    ref = torch.nn.BatchNorm1d(3, momentum=momentum)
    with torch.no_grad():
        w, b = torch.randn(3, generator=g), torch.randn(3, generator=g)
        for m in (sbn, ref):
            m.weight.copy_(w)
            m.bias.copy_(b)
    for step in range(2):
        data = torch.randn(total, *shape, generator=g) * 3 + 1
        coef = torch.randn(total, *shape, generator=g)
        x = data[start:start + sizes[rank]].clone().requires_grad_()
        xr = data.clone().requires_grad_()
        y = sbn(x)
        yr = ref(xr)
        checks.check(close(y, yr[start:start + sizes[rank]], 1e-12),
                     f"{what} step {step}: forward differs")
        (y * coef[start:start + sizes[rank]]).sum().backward()
        (yr * coef).sum().backward()
        checks.check(close(x.grad, xr.grad[start:start + sizes[rank]], 1e-11),
                     f"{what} step {step}: input gradient differs")
        for name in ("weight", "bias"):
            local = getattr(sbn, name).grad
            summed = torch.from_numpy(comm.allreduce(local.numpy()))
            checks.check(close(summed, getattr(ref, name).grad, 1e-11),
                         f"{what} step {step}: {name} gradients summed over ranks differ")
            getattr(sbn, name).grad = None
            getattr(ref, name).grad = None
    checks.check(close(sbn.running_mean, ref.running_mean, 1e-12)
                 and close(sbn.running_var, ref.running_var, 1e-12),
                 f"{what}: running statistics differ")
    checks.check(int(sbn.num_batches_tracked) == 2, f"{what}: num_batches_tracked")
    sbn.eval()
    ref.eval()
    x = torch.randn(3, *shape, generator=g)
    checks.check(close(sbn(x), ref(x), 1e-12), f"{what}: eval mode differs")


def test_sync_batch_norm_refuses_1d(checks):
    checks.expect(ValueError, ["SyncBatchNorm", "2 dimensions"],
                  lambda: hvd.SyncBatchNorm(3)(torch.zeros(3)))
