"""FASTREDUCE_DEBUG=1: calls that differ between the ranks of a communicator raise the same
CollectiveMismatch on every rank, naming what differs; matching calls are unaffected."""

from __future__ import annotations

import faulthandler
import functools
import os

import numpy as np
import torch
from common import WORLD, Failures

import fastreduce

f = Failures()
faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, before the timeout
p, rank = WORLD.size, WORLD.rank
f.check(os.environ.get("FASTREDUCE_DEBUG") == "1" and fastreduce.checks.debug(),
        "debug mode is not on")
# every rank raises CollectiveMismatch, with the same message
expect_everywhere = functools.partial(f.expect_everywhere, same_message=True)


def check_matching_calls_work():
    x = torch.full((5,), float(rank))
    fastreduce.allreduce_(x)
    f.check(torch.equal(x, torch.full((5,), float(sum(range(p))))), "allreduce_ in debug mode")
    y = fastreduce.iallreduce(np.arange(4.0) * rank).wait()
    f.check(np.array_equal(y, np.arange(4.0) * sum(range(p))), "iallreduce in debug mode")
    ts = [torch.ones(3), torch.ones(2, dtype=torch.int32)]
    fastreduce.allreduce_coalesced_(ts)
    f.check(all(int(t[0]) == p for t in ts), "coalesced in debug mode")


def check_mismatches():
    if p == 1:
        return
    n = 4 if rank != p - 1 else 5  # the last rank passes one element more
    expect_everywhere(lambda: fastreduce.allreduce_(torch.zeros(n)),
                      ["count", f"rank {p - 1} passed 5", "allreduce_"])
    dtype = torch.float64 if rank == 0 else torch.float32
    expect_everywhere(lambda: fastreduce.allreduce(torch.zeros(3, dtype=dtype)),
                      ["dtype", "float64", "float32"])
    op = "max" if rank == 1 else "sum"
    expect_everywhere(lambda: fastreduce.allreduce_(torch.zeros(3), op),
                      ["op", "'max'", "rank 1"])
    # a rank that skipped a call: its next call pairs with the one it skipped
    n = 7 if rank == 0 else 2
    expect_everywhere(lambda: fastreduce.allreduce_(torch.zeros(n)),
                      ["count", "rank 0 passed 7"])
    # blocking against non-blocking on the same communicator
    comm = WORLD.Dup()

    def mixed():
        x = torch.zeros(3)
        if rank == 0:
            fastreduce.iallreduce_(x, comm=comm).wait()
        else:
            fastreduce.allreduce_(x, comm=comm)

    expect_everywhere(mixed, ["call", "iallreduce_", "allreduce_"])
    # after a mismatch the communicators still work
    x = torch.ones(2)
    fastreduce.allreduce_(x, comm=comm)
    f.check(torch.equal(x, torch.full((2,), float(p))), "allreduce after mismatches")
    comm.Free()


def check_layers_and_gradsync():
    from fastreduce.nn import AllSumReduce

    P = fastreduce.Partition().create_cartesian_topology_partition([p])
    layer = AllSumReduce(P, axes_reduce=[0])
    x = torch.ones(3, requires_grad=True)
    layer(x).sum().backward()
    f.check(torch.equal(x.grad, torch.full((3,), float(p))), "layer backward in debug mode")
    if p > 1:
        n = 3 if rank else 4
        expect_everywhere(lambda: layer(torch.ones(n)), ["count"])
    model = torch.nn.Linear(4, 2)
    sync = fastreduce.GradientSync(model)
    model(torch.ones(1, 4)).sum().backward()
    sync.wait()
    f.check(model.weight.grad is not None, "GradientSync in debug mode")


def check_torch_backend():
    import torch.distributed as dist

    import fastreduce.distributed  # noqa: F401

    dist.init_process_group("fastreduce")
    t = torch.ones(2)
    dist.broadcast(t, src=0)
    if p > 1:
        src = 0 if rank else 1
        expect_everywhere(lambda: dist.broadcast(torch.ones(2), src=src), ["root"])
        n = 2 if rank else 3
        expect_everywhere(lambda: dist.all_gather_into_tensor(torch.empty(p * n),
                                                              torch.ones(n)), ["bytes"])
    dist.destroy_process_group()


def check_setup_refused_everywhere():
    """Every rank refusing a set-up call alike (the same bytes exchanged): each raises its
    own error, as outside debug mode, and nothing is made."""
    f.expect(ValueError, ["repeat a rank"],
             lambda: fastreduce.Partition().create_partition_inclusive([0, 0]))
    f.expect(ValueError, ["not in this partition"],
             lambda: fastreduce.Partition().create_partition_inclusive([p]))


f.run("set-up refused everywhere", check_setup_refused_everywhere)
f.run("matching calls", check_matching_calls_work)
f.run("mismatches", check_mismatches)
f.run("layers and GradientSync", check_layers_and_gradsync)
f.run("torch.distributed backend", check_torch_backend)
f.finish()
