"""Training through torch.distributed on the fastreduce backend equals the same training on
gloo, in one job, same seeds, float64: DDP (plain, find_unused_parameters, no_sync gradient
accumulation, a comm hook), ZeroRedundancyOptimizer, FSDP2 (fully_shard), and a
torch.distributed.checkpoint save and load. argv[1]: a folder shared by the ranks."""

import faulthandler
import sys

import torch
import torch.distributed as dist
from common import Failures
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fastreduce.distributed  # noqa: F401  (registers the backend)

dist.init_process_group("fastreduce")
rank, size = dist.get_rank(), dist.get_world_size()
f = Failures()
faulthandler.dump_traceback_later(150, exit=True)
world = dist.group.WORLD
gloo = dist.new_group(backend="gloo")
torch.set_default_dtype(torch.float64)
STEPS = 4


class Net(nn.Module):
    def __init__(self, unused_branch: bool = False):
        super().__init__()
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 6)
        self.unused = nn.Linear(24, 6) if unused_branch else None

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)


def fresh(unused_branch=False):
    torch.manual_seed(0)
    return Net(unused_branch)


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def same_params(m1, m2, what):
    p1, p2 = dict(m1.named_parameters()), dict(m2.named_parameters())
    bad = [n for n in p1 if not close(p1[n].detach(), p2[n].detach())]
    f.check(not bad, f"{what}: parameters {bad} differ from gloo's")


def ddp_run(pg, *, unused=False, accumulate=False, hook=False):
    model = fresh(unused)
    ddp = DDP(model, process_group=pg, find_unused_parameters=unused)
    if hook:
        ddp.register_comm_hook(pg, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        if accumulate:
            with ddp.no_sync():
                x, y = batch(step, 1)
                nn.functional.mse_loss(ddp(x), y).backward()
        x, y = batch(step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return model


def check_ddp(**kw):
    ours, theirs = ddp_run(world, **kw), ddp_run(gloo, **kw)
    same_params(ours, theirs, f"DDP {kw}")
    # and every rank holds the same model
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    copy = flat.clone()
    dist.broadcast(copy, src=0)
    f.check(torch.equal(flat, copy), f"DDP {kw}: ranks hold different models")


def check_ddp_gradients_are_averages():
    """One DDP step's gradients equal the mean of every rank's local gradients."""
    ddp = DDP(fresh(), process_group=world)
    x, y = batch(0)
    nn.functional.mse_loss(ddp(x), y).backward()
    local = []
    for r in range(size):
        m = fresh()
        g = torch.Generator().manual_seed(10_000 * r)
        xr, yr = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
        nn.functional.mse_loss(m(xr), yr).backward()
        local.append([p.grad for p in m.parameters()])
    for i, p in enumerate(ddp.module.parameters()):
        want = sum(grads[i] for grads in local) / size
        f.check(close(p.grad, want), f"DDP gradient {i} is not the mean of the ranks'")


def zero_run(pg):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = fresh()
    ddp = DDP(model, process_group=pg)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                  process_group=pg, lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    opt.consolidate_state_dict(to=0)
    return model


def check_zero():
    same_params(zero_run(world), zero_run(gloo), "ZeroRedundancyOptimizer")


def fsdp_run(pg):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(pg, "cpu")
    model = fresh()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def check_fsdp2():
    ours, theirs = fsdp_run(world), fsdp_run(gloo)
    bad = [n for n in ours if not close(ours[n], theirs[n])]
    f.check(not bad, f"FSDP2: parameters {bad} differ from gloo's")


def check_checkpoint(folder: str):
    import torch.distributed.checkpoint as dcp

    model = ddp_run(world)
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=folder)
    restored = Net()
    target = {"model": restored.state_dict()}
    dcp.load(target, checkpoint_id=folder)
    restored.load_state_dict(target["model"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  restored.state_dict().values(), strict=True))
    f.check(same, "checkpoint: the loaded model differs from the saved one")


f.run("ddp", check_ddp)
f.run("ddp find_unused_parameters", lambda: check_ddp(unused=True))
f.run("ddp no_sync", lambda: check_ddp(accumulate=True))
f.run("ddp comm hook", lambda: check_ddp(hook=True))
f.run("ddp gradients", check_ddp_gradients_are_averages)
f.run("zero", check_zero)
f.run("fsdp2", check_fsdp2)
f.run("checkpoint", check_checkpoint, sys.argv[1])
dist.barrier()
dist.destroy_process_group()
f.finish()
