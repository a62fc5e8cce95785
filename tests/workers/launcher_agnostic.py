"""Core all-reduce and node-local rank, whatever launched us (mpiexec or srun)."""

import socket

import numpy as np
import torch
from common import WORLD, Failures

import fastreduce

fails = Failures()
p, rank = WORLD.size, WORLD.rank
x = torch.arange(6, dtype=torch.float64) * (rank + 1)
fails.check(torch.equal(fastreduce.allreduce(x), torch.arange(6, dtype=torch.float64)
                        * p * (p + 1) / 2), "allreduce")
a = np.full(3, rank, dtype=np.int32)
fastreduce.allreduce_(a, "max")
fails.check(np.array_equal(a, np.full(3, p - 1)), "allreduce_ max numpy")
# the node-local rank from the hostnames: ranks that share a host share a node
hosts = WORLD.allgather(socket.gethostname())
local, local_size = hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank])
fails.check(fastreduce.local_rank() == local and fastreduce.local_size() == local_size,
            f"local rank {fastreduce.local_rank()}/{fastreduce.local_size()}")
req = fastreduce.iallreduce(torch.ones(4))
fails.check(torch.equal(req.wait(), torch.full((4,), float(p))), "iallreduce")
if rank == 0:
    print("launched with", fastreduce.build_mpi(), flush=True)
fails.finish()
