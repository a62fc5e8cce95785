"""Training through torch.distributed on the fastreduce backend equals the same training on
gloo, in one job, same seeds, float64: DDP (plain, find_unused_parameters, no_sync gradient
accumulation, a comm hook), ZeroRedundancyOptimizer, FSDP2 (fully_shard), and a
torch.distributed.checkpoint save and load."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fastreduce.distributed  # noqa: F401  (registers the backend)

pytestmark = [pytest.mark.mpi(ranks=(1, 2, 3, 4)), pytest.mark.across_nodes,
              pytest.mark.one_mpi, pytest.mark.minimum_versions]

STEPS = 4


@dataclass
class World:
    rank: int
    size: int
    world: dist.ProcessGroup  # the default group, on fastreduce
    gloo: dist.ProcessGroup  # the same ranks on gloo


@pytest.fixture(scope="module")
def world() -> World:
    """The default group on fastreduce and the same ranks on gloo, float64 the default dtype;
    destroyed (and the default dtype restored) at the module's end."""
    dist.init_process_group("fastreduce")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield World(dist.get_rank(), dist.get_world_size(), dist.group.WORLD,
                dist.new_group(backend="gloo"))
    torch.set_default_dtype(default_dtype)
    dist.barrier()
    dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self, unused_branch: bool = False):
        super().__init__()
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 6)
        self.unused = nn.Linear(24, 6) if unused_branch else None

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(rank: int, step: int, micro: int = 0):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)


def fresh(unused_branch=False):
    torch.manual_seed(0)
    return Net(unused_branch)


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def same_params(f, m1, m2, what):
    p1, p2 = dict(m1.named_parameters()), dict(m2.named_parameters())
    bad = [n for n in p1 if not close(p1[n].detach(), p2[n].detach())]
    f.check(not bad, f"{what}: parameters {bad} differ from gloo's")


def ddp_run(rank, pg, *, unused=False, accumulate=False, hook=False):
    model = fresh(unused)
    ddp = DDP(model, process_group=pg, find_unused_parameters=unused)
    if hook:
        ddp.register_comm_hook(pg, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        if accumulate:
            with ddp.no_sync():
                x, y = batch(rank, step, 1)
                nn.functional.mse_loss(ddp(x), y).backward()
        x, y = batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return model


def check_ddp(f, w: World, **kw):
    ours, theirs = ddp_run(w.rank, w.world, **kw), ddp_run(w.rank, w.gloo, **kw)
    same_params(f, ours, theirs, f"DDP {kw}")
    # and every rank holds the same model
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    copy = flat.clone()
    dist.broadcast(copy, src=0)
    f.check(torch.equal(flat, copy), f"DDP {kw}: ranks hold different models")


@pytest.mark.parametrize(("label", "kw"), [
    pytest.param("ddp", {}, id="plain"),
    pytest.param("ddp find_unused_parameters", {"unused": True}, id="find_unused_parameters"),
    pytest.param("ddp no_sync", {"accumulate": True}, id="no_sync"),
    pytest.param("ddp comm hook", {"hook": True}, id="comm_hook"),
])
def test_ddp_equals_gloo(world, checks, label, kw):
    """DDP's model after a few steps is gloo's, and the same on every rank."""
    checks.run(label, lambda: check_ddp(checks, world, **kw))


def test_ddp_gradients_are_averages(world, checks):
    """One DDP step's gradients equal the mean of every rank's local gradients."""
    def body():
        ddp = DDP(fresh(), process_group=world.world)
        x, y = batch(world.rank, 0)
        nn.functional.mse_loss(ddp(x), y).backward()
        local = []
        for r in range(world.size):
            m = fresh()
            g = torch.Generator().manual_seed(10_000 * r)
            xr, yr = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
            nn.functional.mse_loss(m(xr), yr).backward()
            local.append([p.grad for p in m.parameters()])
        for i, p in enumerate(ddp.module.parameters()):
            want = sum(grads[i] for grads in local) / world.size
            checks.check(close(p.grad, want), f"DDP gradient {i} is not the mean of the ranks'")

    checks.run("ddp gradients", body)


class Wide(nn.Module):
    """Buckets of more than 64 KiB: DDP's asyncOp all-reduces go to the progress engine,
    where the gradient schedule applies."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 128)
        self.b = nn.Linear(128, 128)
        self.c = nn.Linear(128, 6)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_ddp_follows_the_gradient_schedule(world, checks):
    """DDP's buckets on the backend: "auto" times the overlap and serial schedules on the
    first steps and keeps one, the same on every rank; the model is gloo's throughout."""
    from fastreduce.backend import engine  # noqa: PLC0415
    from fastreduce.torch.buckets import CALIBRATION_STEPS  # noqa: PLC0415

    if not hasattr(dist.AllreduceOptions(), "asyncOp"):
        pytest.skip(f"torch {torch.__version__}'s options do not say whether DDP waits: the "
                    f"backend runs each bucket's reduction at the call, with no schedule")
    if not engine.state()[0] or engine.host_bytes() < 0:
        pytest.skip(f"no DDP bucket reaches the progress engine ({engine.state()[1]}, host "
                    f"bytes {engine.host_bytes()})")
    backend = world.world
    backend._buckets = None  # a fresh schedule for this case
    steps = 1 + 2 * CALIBRATION_STEPS + 2
    models = []
    for pg in (world.world, world.gloo):
        torch.manual_seed(0)
        model = Wide()
        ddp = DDP(model, process_group=pg, bucket_cap_mb=0.1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(world.rank, step)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        models.append(model)
    same_params(checks, models[0], models[1], "DDP under the gradient schedule")
    chooser = backend._buckets.chooser
    checks.check(chooser.decided and set(chooser.measured) == {"overlap", "serial"},
                 f"not decided after {steps} steps: {chooser.measured}")
    chosen = [None] * world.size
    dist.all_gather_object(chosen, (chooser.mode, chooser.measured), group=world.gloo)
    checks.check(all(c == chosen[0] for c in chosen), f"ranks chose differently: {chosen}")


def zero_run(rank, pg):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = fresh()
    ddp = DDP(model, process_group=pg)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                  process_group=pg, lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    opt.consolidate_state_dict(to=0)
    return model


def test_zero_redundancy_optimizer_equals_gloo(world, checks):
    checks.run("zero", lambda: same_params(checks, zero_run(world.rank, world.world),
                                           zero_run(world.rank, world.gloo),
                                           "ZeroRedundancyOptimizer"))


def fsdp_run(rank, pg):
    model, opt = fsdp_model(pg, 0, torch.optim.SGD, lr=0.1)
    train(model, opt, rank, range(STEPS))
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def test_fsdp2_equals_gloo(world, checks):
    """FSDP2 (fully_shard on a layer and on the model)."""
    def body():
        ours, theirs = fsdp_run(world.rank, world.world), fsdp_run(world.rank, world.gloo)
        bad = [n for n in ours if not close(ours[n], theirs[n])]
        checks.check(not bad, f"FSDP2: parameters {bad} differ from gloo's")

    checks.run("fsdp2", body)


def test_checkpoint_save_and_load(world, checks, shared_tmp_path):
    """A torch.distributed.checkpoint of a DDP model, saved to a folder every rank shares,
    loads back into a fresh model unchanged."""
    def body():
        import torch.distributed.checkpoint as dcp

        folder = str(shared_tmp_path / "checkpoint")
        model = ddp_run(world.rank, world.world)
        state = {"model": model.state_dict()}
        dcp.save(state, checkpoint_id=folder)
        restored = Net()
        target = {"model": restored.state_dict()}
        dcp.load(target, checkpoint_id=folder)
        restored.load_state_dict(target["model"])
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                      restored.state_dict().values(),
                                                      strict=True))
        checks.check(same, "checkpoint: the loaded model differs from the saved one")

    checks.run("checkpoint", body)


def fsdp_model(pg, seed: int, optimizer=torch.optim.Adam, lr: float = 0.01):
    """Net made from `seed`, fully_shard on a layer and on the model over pg's mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    if not hasattr(torch.cpu.Stream, "record_event"):  # torch 2.4 and 2.6
        pytest.skip(f"torch {torch.__version__}'s FSDP2 does not run on the CPU, on gloo "
                    f"either (2.4: CUDA in its pre-forward; 2.6: no CPU stream events)")
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(pg, "cpu")
    torch.manual_seed(seed)
    model = Net()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, optimizer(model.parameters(), lr=lr)


def train(model, opt, rank: int, steps) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fsdp_resume_run(rank: int, pg, folder: str):
    """FSDP2 with Adam, as PyTorch's FSDP2 example with --dcp-api: 2 steps, a sharded
    torch.distributed.checkpoint of model and optimizer, 2 more steps; then a model made
    differently loads the checkpoint and takes the same 2 steps. Both runs' losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = fsdp_model(pg, 0)
    losses = train(model, opt, rank, range(2))
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder,
             process_group=pg)
    losses += train(model, opt, rank, range(2, 4))
    again, again_opt = fsdp_model(pg, 1)  # other initial values: the load must replace them
    model_state, optim_state = get_state_dict(again, again_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder, process_group=pg)
    set_state_dict(again, again_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return losses, train(again, again_opt, rank, range(2, 4))


def test_fsdp2_checkpoint_resume_equals_gloo(world, checks, shared_tmp_path):
    """A resumed FSDP2 run continues exactly where the saved one went on, and both equal
    the same runs on gloo."""
    def body():
        ours, resumed = fsdp_resume_run(world.rank, world.world,
                                        str(shared_tmp_path / "fsdp-fastreduce"))
        theirs, theirs_resumed = fsdp_resume_run(world.rank, world.gloo,
                                                 str(shared_tmp_path / "fsdp-gloo"))
        checks.check(resumed == ours[2:], f"resumed losses {resumed} != {ours[2:]}")
        checks.check(all(close(torch.tensor(a), torch.tensor(b))
                         for a, b in zip(ours + resumed, theirs + theirs_resumed, strict=True)),
                     f"losses {ours} {resumed} differ from gloo's {theirs} {theirs_resumed}")

    checks.run("fsdp2 checkpoint resume", body)


def tensor_parallel_run(pg) -> list[float]:
    """Net's two layers split across the ranks, column-wise then row-wise, on a device
    mesh over pg; every rank feeds the same batches."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = DeviceMesh.from_group(pg, "cpu")
    model = parallelize_module(fresh(), mesh, {"a": ColwiseParallel(),
                                               "b": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return train(model, opt, 0, range(STEPS))


def test_tensor_parallel_equals_gloo(world, checks):
    def body():
        ours, theirs = tensor_parallel_run(world.world), tensor_parallel_run(world.gloo)
        checks.check(all(close(torch.tensor(a), torch.tensor(b))
                         for a, b in zip(ours, theirs, strict=True)),
                     f"tensor parallel losses {ours} differ from gloo's {theirs}")

    checks.run("tensor parallel", body)
