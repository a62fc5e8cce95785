"""GradientSync against the one-by-one reference (an MLP trained a few steps matches it on
every rank); accumulation; refused misuse; bad input.

Every case also runs on 3 ranks with every bucket through the progress engine
(FASTREDUCE_ENGINE_HOST_BYTES=0) and with none (off): the same gradients.
"""

from __future__ import annotations

import pytest
import torch
from models import MLP
from mpi4py import MPI

import fastreduce

WORLD = MPI.COMM_WORLD
p, rank = WORLD.size, WORLD.rank
STEPS = 4


@pytest.fixture(autouse=True, params=[
    pytest.param("default", marks=[pytest.mark.mpi(ranks=(1, 2, 3, 4)),
                                   pytest.mark.across_nodes, pytest.mark.minimum_versions]),
    pytest.param("engine-every-size", marks=pytest.mark.mpi(ranks=3,
                                                            profile="engine-every-size")),
    pytest.param("engine-host-off", marks=pytest.mark.mpi(ranks=3, profile="engine-host-off")),
])
def engine(request):
    """The session's profile: the default, every bucket through the progress engine
    (FASTREDUCE_ENGINE_HOST_BYTES=0), or none (off)."""
    from fastreduce.backend import engine

    want = {"default": engine.DEFAULT_HOST_BYTES, "engine-every-size": 0,
            "engine-host-off": -1}[request.param]
    assert engine.host_bytes() == want, f"profile {request.param}: {engine.host_bytes()}"
    return request.param


@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["one-bucket", "tiny-buckets"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_training_matches_the_reference(checks, dtype, bucket_mb):
    """A few SGD steps with momentum: each step's gradients equal the one-by-one all-reduce
    of the reference model's, and the parameters end equal on every rank."""
    torch.manual_seed(1234 + rank)  # different initial weights: sync must make them equal
    model = MLP(dtype)
    reference = MLP(dtype)
    sync = fastreduce.GradientSync(model, bucket_mb=bucket_mb)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    sync.attach(opt)
    g = torch.Generator().manual_seed(99 + rank)
    for step in range(STEPS):
        x = torch.randn(8, 6, generator=g, dtype=dtype)
        use = (step + rank) % 2 == 0
        opt.zero_grad()
        ref_opt.zero_grad()
        model(x, use).square().mean().backward()
        reference(x, use).square().mean().backward()
        sync.wait()
        for prm in reference.parameters():  # the one-by-one reference
            if prm.grad is None:
                prm.grad = torch.zeros_like(prm)
            fastreduce.allreduce_(prm.grad)
            prm.grad /= p
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
            if dtype == torch.float64 and p <= 2:
                same = torch.equal(a.grad, b.grad)
            else:  # other rank counts may combine the bucket in another order than one tensor
                same = torch.allclose(a.grad, b.grad, rtol=1e-5 if dtype == torch.float32
                                      else 1e-12, atol=1e-7 if dtype == torch.float32 else 1e-15)
            checks.check(same, f"{dtype} bucket {bucket_mb} step {step}: grad of {name} "
                               f"differs by {(a.grad - b.grad).abs().max().item():.3g}")
        opt.step()
        ref_opt.step()
    flat = torch.cat([q.detach().reshape(-1).double() for q in model.parameters()])
    everyone = WORLD.allgather(flat.numpy())
    checks.check(all((e == everyone[0]).all() for e in everyone),
                 f"{dtype}: parameters differ across ranks")
    if bucket_mb < 1:
        checks.check(len(sync.bucket_sizes) > 3, f"buckets {sync.bucket_sizes}")


def test_no_sync_accumulation(checks):
    """Gradient accumulation under no_sync, then one synchronised backward."""
    torch.manual_seed(5)
    model = MLP(torch.float64)
    sync = fastreduce.GradientSync(model)
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with sync.no_sync():
        model(x, True).sum().backward()
    model(x, True).sum().backward()
    sync.wait()
    local = MLP(torch.float64)
    local.load_state_dict(model.state_dict())
    (2 * local(x, True).sum()).backward()
    w = local.layers[0].weight.grad.clone()
    fastreduce.allreduce_(w)
    checks.check(torch.allclose(model.layers[0].weight.grad, w / p, atol=1e-12),
                 "no_sync accumulation")


def test_second_backward_in_flight_is_refused(checks):
    """A second backward while buckets are in flight is refused before it touches them."""
    torch.manual_seed(6)
    small = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    sync = fastreduce.GradientSync(small, bucket_mb=1e-5)  # a bucket per parameter
    xs = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
    small(xs).sum().backward()
    checks.expect(RuntimeError, ["already being reduced", "no_sync"],
                  lambda: small(xs).sum().backward())
    sync.wait()
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    ref.load_state_dict(small.state_dict())
    ref(xs).sum().backward()
    for a, b in zip(small.parameters(), ref.parameters(), strict=True):
        fastreduce.allreduce_(b.grad)
        checks.check(torch.allclose(a.grad, b.grad / p, atol=1e-6),
                     "refused backward left grads intact")


def test_bad_input(checks):
    expect = checks.expect
    expect(ValueError, ["bucket_mb must be positive"],
           lambda: fastreduce.GradientSync(MLP(torch.float32), bucket_mb=0))
    expect(ValueError, ["bucket_mb must be positive"],
           lambda: fastreduce.GradientSync(MLP(torch.float32), bucket_mb=-1))
    expect(ValueError, ["no parameters"], lambda: fastreduce.GradientSync(torch.nn.ReLU()))
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    expect(ValueError, ["requires grad"], lambda: fastreduce.GradientSync(frozen))
    expect(TypeError, ["torch.nn.Module"], lambda: fastreduce.GradientSync([torch.ones(2)]))
    expect(ValueError, ["'avg' or 'sum'"], lambda: fastreduce.GradientSync(MLP(torch.float32),
                                                                            op="max"))
