"""GradientSync against the one-by-one reference (an MLP trained a few steps matches it on
every rank); accumulation; refused misuse; bad input.

Every case also runs on 3 ranks with every bucket through the progress engine
(engine.set_host(True), as FASTREDUCE_ENGINE_HOST_BYTES=0) and with none (off): the same
gradients.
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
    pytest.param("engine-every-size", marks=pytest.mark.mpi(ranks=3)),
    pytest.param("engine-host-off", marks=pytest.mark.mpi(ranks=3)),
])
def engine(request):
    """The progress engine's host threshold as the environment says (default), every
    bucket through the engine (0 bytes), or none (MPI's non-blocking collectives)."""
    from fastreduce.backend import engine

    engine.set_host({"default": None, "engine-every-size": True,
                     "engine-host-off": False}[request.param])
    try:
        want = {"default": engine.DEFAULT_HOST_BYTES, "engine-every-size": 0,
                "engine-host-off": -1}[request.param]
        assert engine.host_bytes() == want, f"{request.param}: {engine.host_bytes()}"
        yield request.param
    finally:
        engine.set_host(None)


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
    expect(ValueError, ["schedule='fast'", "'auto'", "'overlap'", "'serial'"],
           lambda: fastreduce.GradientSync(MLP(torch.float32), schedule="fast"))


@pytest.mark.parametrize("differs", ["width", "depth", "dtype", "frozen"])
def test_models_that_differ_between_ranks(checks, differs):
    """A different model on the last rank: GradientSync raises ValueError on every rank at
    construction, naming what differs (before, the first step failed in MPI on one rank and
    hung on the others); the ranks' parameters are untouched."""
    if p == 1:
        pytest.skip("needs ranks whose models differ")
    odd = rank == p - 1
    if differs == "width":
        model = torch.nn.Linear(6, 5 if odd else 4)
    elif differs == "depth":
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3 if odd else 2)])
    else:
        model = torch.nn.Linear(4, 4, dtype=torch.float64 if odd and differs == "dtype"
                                else torch.float32)
        if differs == "frozen" and odd:
            model.bias.requires_grad_(False)
    words = {"width": ["parameter 0", "(5, 6)", "(4, 6)"], "depth": ["parameters", "6", "4"],
             "dtype": ["parameter 0", "float64", "float32"], "frozen": ["trained", "frozen"]}
    before = [t.detach().clone() for t in model.parameters()]
    checks.expect(ValueError, ["ranks' modules differ", *words[differs],
                               f"rank {p - 1} has"],
                  lambda: fastreduce.GradientSync(model))
    checks.check(all(torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                        strict=True)),
                 "a refused GradientSync changed the parameters")


class Reversed(torch.nn.Module):
    """Layers registered in the reverse of the order forward uses them, so backward makes
    their gradients in registration order: the opposite of what the plan assumes."""

    def __init__(self) -> None:
        super().__init__()
        self.late = torch.nn.Linear(16, 2)
        self.middle = torch.nn.Linear(16, 16)
        self.early = torch.nn.Linear(6, 16)

    def forward(self, x):
        return self.late(torch.tanh(self.middle(torch.tanh(self.early(x)))))


def _train(model, sync, steps: int, seed: int = 7) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync.attach(opt)
    g = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 6, generator=g)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("schedule", ["overlap", "serial", "serial-in-place", "serial-flat"])
def test_schedules_match_the_reference(checks, monkeypatch, schedule):
    """Each schedule, fixed, gives the one-by-one reference's gradients on every step
    (serial-in-place: every gradient counts as large and is reduced where autograd left it,
    a layer without gradient on some ranks among them; serial-flat: the serial schedule's
    flat form only, every gradient in the flat buffer, one call). The serial schedule
    reduces host gradients with blocking calls, none handed to the progress engine."""
    from fastreduce.torch import buckets, gradsync  # noqa: PLC0415

    started = []
    real = gradsync.iallreduce_
    monkeypatch.setattr(gradsync, "iallreduce_",
                        lambda *args, **kwargs: started.append(1) or real(*args, **kwargs))
    if schedule == "serial-in-place":
        monkeypatch.setattr(buckets, "DIRECT_BYTES", 0)
        monkeypatch.setattr(buckets, "SERIAL_FORMS", ("in place",))
        schedule = "serial"
    if schedule == "serial-flat":
        monkeypatch.setattr(buckets, "DIRECT_BYTES", 0)
        monkeypatch.setattr(buckets, "SERIAL_FORMS", ("flat",))
        schedule = "serial"
    torch.manual_seed(3)
    model, reference = Reversed(), Reversed()
    reference.load_state_dict(model.state_dict())
    sync = fastreduce.GradientSync(model, bucket_mb=0.002, schedule=schedule)
    g = torch.Generator().manual_seed(11 + rank)
    for step in range(3):
        x = torch.randn(5, 6, generator=g)
        model.zero_grad()
        reference.zero_grad()
        # the last layer's bias gets no gradient on odd ranks at step 1
        skip = step == 1 and rank % 2 == 1
        for m in (model, reference):
            m.late.bias.requires_grad_(not skip)
            m(x).square().mean().backward()
            m.late.bias.requires_grad_(True)
        sync.wait()
        checks.check(sync.schedule == schedule, f"schedule {sync.schedule}")
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
            want = torch.zeros_like(b) if b.grad is None else b.grad.clone()
            fastreduce.allreduce_(want, "avg")
            checks.check(torch.allclose(a.grad, want, rtol=1e-5, atol=1e-7),
                         f"{schedule} step {step}: grad of {name}")
        checks.check(bool(started) == (schedule == "overlap"),
                     f"{schedule}: {len(started)} non-blocking reductions by step {step}")
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            with torch.no_grad():
                a.add_(a.grad, alpha=-0.1)
                b.copy_(a)


def test_auto_chooses_one_schedule_everywhere(checks, comm):
    """auto: a warm-up step, CALIBRATION_STEPS of each schedule, then one choice, the same on
    every rank, with what it measured: overlap only if it is OVERLAP_MARGIN faster."""
    from fastreduce.torch.buckets import CALIBRATION_STEPS, OVERLAP_MARGIN  # noqa: PLC0415

    model = Reversed()
    sync = fastreduce.GradientSync(model, bucket_mb=0.002, schedule="auto")
    _train(model, sync, 1 + 2 * CALIBRATION_STEPS - 1)
    checks.check(sync.measured == {}, f"decided early: {sync.measured}")
    _train(model, sync, 1)
    checks.check(set(sync.measured) == {"overlap", "serial"}, f"measured {sync.measured}")
    checks.check(all(v > 0 for v in sync.measured.values()), f"measured {sync.measured}")
    chosen = comm.allgather((sync.schedule, sync.measured))
    checks.check(all(c == chosen[0] for c in chosen), f"ranks chose differently: {chosen}")
    overlap, serial = sync.measured["overlap"], sync.measured["serial"]
    want = "overlap" if overlap < (1 - OVERLAP_MARGIN) * serial else "serial"
    checks.check(sync.schedule == want, f"chose {sync.schedule}, measured {sync.measured}")
    for fixed in ("overlap", "serial"):
        other = Reversed()
        forced = fastreduce.GradientSync(other, bucket_mb=0.002, schedule=fixed)
        _train(other, forced, 1 + 2 * CALIBRATION_STEPS)
        checks.check(forced.schedule == fixed and forced.measured == {},
                     f"{fixed}: {forced.schedule} {forced.measured}")


def test_auto_times_the_serial_forms(checks, comm, monkeypatch):
    """With gradients reduced in place (DIRECT_BYTES 0), auto also times the serial
    schedule's two forms, in turns, and keeps the faster, the same on every rank; the
    gradients equal the one-by-one reference's in every step, whichever form ran it. A fixed
    serial schedule times only its forms: `measured` stays empty."""
    from fastreduce.torch import buckets  # noqa: PLC0415

    monkeypatch.setattr(buckets, "DIRECT_BYTES", 0)
    steps = 1 + 2 * buckets.CALIBRATION_STEPS
    for schedule in ("auto", "serial"):
        torch.manual_seed(5)
        model, reference = Reversed(), Reversed()
        reference.load_state_dict(model.state_dict())
        sync = fastreduce.GradientSync(model, bucket_mb=0.002, schedule=schedule)
        g = torch.Generator().manual_seed(13 + rank)
        ran = []
        for step in range(steps + 1):
            ran.append((sync.schedule, sync.serial_form))
            x = torch.randn(5, 6, generator=g)
            model.zero_grad()
            reference.zero_grad()
            for m in (model, reference):
                m(x).square().mean().backward()
            sync.wait()
            for (name, a), b in zip(model.named_parameters(), reference.parameters(),
                                    strict=True):
                want = b.grad.clone()
                fastreduce.allreduce_(want, "avg")
                checks.check(torch.allclose(a.grad, want, rtol=1e-5, atol=1e-7),
                             f"{schedule} step {step} ({ran[-1]}): grad of {name}")
            with torch.no_grad():
                for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                    a.add_(a.grad, alpha=-0.1)
                    b.copy_(a)
        chooser = sync._engine.chooser
        checks.check(chooser.decided, f"{schedule}: not decided after {steps} steps")
        checks.check(set(chooser.serial_forms) == {"in place", "flat"},
                     f"{schedule}: serial forms {chooser.serial_forms}")
        serial_ran = [form for mode, form in ran if mode == "serial"]
        checks.check({"in place", "flat"} <= set(serial_ran), f"{schedule}: ran {ran}")
        if schedule == "auto":
            checks.check(set(sync.measured) == {"overlap", "serial"}, f"{sync.measured}")
            want = buckets.choose(sync.measured["overlap"], chooser.serial_forms)
        else:
            checks.check(sync.measured == {} and all(m == "serial" for m, _ in ran),
                         f"serial: {sync.measured} {ran}")
            want = buckets.choose(None, chooser.serial_forms)
        checks.check((sync.schedule, sync.serial_form) == want,
                     f"{schedule}: kept {sync.schedule}, {sync.serial_form}; measured "
                     f"{sync.measured} {chooser.serial_forms}")
        chosen = comm.allgather((sync.schedule, sync.serial_form, chooser.serial_forms))
        checks.check(all(c == chosen[0] for c in chosen), f"ranks chose differently: {chosen}")
        sync.remove()


def test_buckets_rebuilt_in_arrival_order(checks):
    """After the first step the buckets follow the order the gradients arrived (rank 0's),
    so the first bucket holds the layer backward reaches first."""
    model = Reversed()
    sync = fastreduce.GradientSync(model, bucket_mb=1e-5, schedule="overlap")  # one per tensor
    planned = [b.params[0] for b in sync._engine.buckets]
    checks.check(planned[0] is model.early.bias, "the plan starts from the last registered")
    _train(model, sync, 1)
    rebuilt = [b.params[0] for b in sync._engine.buckets]
    checks.check(any(rebuilt[0] is q for q in (model.late.weight, model.late.bias)),
                 f"first bucket after the rebuild: {rebuilt[0].shape}")
    checks.check({id(q) for q in rebuilt} == {id(q) for q in planned}, "parameters lost")
    for q in model.parameters():  # .grad still views the (new) buckets
        checks.check(any(q.grad is v for b in sync._engine.buckets for v in b.views),
                     f"grad of {tuple(q.shape)} is not a bucket view")


def test_timeline(checks, shared_tmp_path):
    """timeline=: every rank's Chrome trace holds each bucket's phases per step; with the
    overlap schedule the first bucket is reduced before backward has filled the last."""
    import json

    model = Reversed()
    path = shared_tmp_path / "timeline-{rank}.json"
    sync = fastreduce.GradientSync(model, bucket_mb=1e-5, schedule="overlap", timeline=path)
    _train(model, sync, 3)
    sync.remove()
    events = json.loads((shared_tmp_path / f"timeline-{rank}.json").read_text())
    names = {e["name"] for e in events}
    checks.check(names == {"FILL", "QUEUED", "REDUCE", "WAIT"}, f"phases {names}")
    rows = {e["tid"] for e in events}
    checks.check(len(rows) == len(sync.bucket_sizes), f"rows {rows}")
    checks.check(all(e["ph"] == "X" and e["dur"] >= 0 for e in events), "malformed events")
    last_step = events[-4 * len(rows):]
    first = min(e["ts"] for e in last_step if e["name"] == "REDUCE")
    filled = max(e["ts"] + e["dur"] for e in last_step if e["name"] == "FILL")
    checks.check(first < filled, "no reduction started before backward ended")
