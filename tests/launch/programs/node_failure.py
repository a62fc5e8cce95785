"""A job that a node's failure interrupts (tests/launch/test_node_failures.py does the failing).

argv[1] "allreduce": rank 0 says "failure point" while every rank repeats a 64 MiB
all-reduce; "gradsync": it says so at step 3 of a GradientSync training loop. Neither
ever finishes on its own: the test takes a node's link down or kills its ranks.
"""

import socket
import sys
import time

import torch
from mpi4py import MPI

import fastreduce

WORLD = MPI.COMM_WORLD
mode = sys.argv[1]
print(f"rank {WORLD.rank} on {socket.gethostname()}", flush=True)
if mode == "allreduce":
    x = torch.ones(16 * 1024 * 1024)
    fastreduce.allreduce_(x)
    for i in range(100_000):
        if i == 1 and WORLD.rank == 0:
            print("failure point: in the large all-reduce", flush=True)
        fastreduce.allreduce_(x)
        x.fill_(1.0)
elif mode == "gradsync":
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 10))
    sync = fastreduce.GradientSync(model, bucket_mb=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sync.attach(opt)
    for step in range(100_000):
        if step == 3 and WORLD.rank == 0:
            print("failure point: step 3 of GradientSync", flush=True)
        opt.zero_grad()
        model(torch.randn(64, 512)).square().mean().backward()
        sync.wait()
        opt.step()
        time.sleep(0.01)
print("not reached in the test: the job finished", flush=True)
