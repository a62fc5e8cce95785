"""FASTREDUCE_TIMEOUT: a rank that never arrives; the others' watchdog prints the flight
record and aborts the job. argv[1]: how long the late rank sleeps; argv[2]: where it is
late: "allreduce" (after a few calls that complete), or before the first collective of
"first-allreduce" (the default communicator is made), "partition" (a Cartesian partition
agreed and made), "local-rank" (the node's communicator split), "horovod" (a blocking
hvd.allreduce after hvd.init(): the ranks' matching by name), "torch-group" (a blocking
dist.all_reduce on a fastreduce group whose timeout is argv[3] seconds), "torch-group-async"
(a non-blocking dist.all_gather_into_tensor of 4 MiB there, run by the progress engine,
waited for)."""

import sys
import time

import torch
from checks import WORLD

import fastreduce

where = sys.argv[2] if len(sys.argv) > 2 else "allreduce"
if where.startswith("torch-group"):  # the group's timeout bounds its calls by itself
    import datetime

    import torch.distributed as dist

    import fastreduce.distributed  # noqa: F401  (the backend and its MPI rendezvous)

    dist.init_process_group("fastreduce",
                            timeout=datetime.timedelta(seconds=float(sys.argv[3])))
    dist.all_reduce(torch.ones(4))  # one that completes, for the record

    def gather_async():
        part = torch.ones(1 << 20)
        dist.all_gather_into_tensor(torch.empty(WORLD.size << 20), part, async_op=True).wait()

    if where == "torch-group-async":
        gather_async()  # one that completes: the engine's communicator made
else:
    assert fastreduce.watchdog.timeout() is not None, "FASTREDUCE_TIMEOUT is not set"
if where == "allreduce":
    x = torch.ones(4)
    fastreduce.allreduce_(x)          # a few collectives that complete, for the record
    fastreduce.allreduce(x, "max")
if where == "partition":
    fastreduce.default_comm()  # made by every rank: the agreement is what waits
if where == "horovod":
    import fastreduce.horovod as hvd
    hvd.init()
if WORLD.rank == 1:
    time.sleep(float(sys.argv[1]))  # late: the others wait in the next collective
if where in ("allreduce", "first-allreduce"):
    fastreduce.allreduce_(torch.ones(1000))
elif where == "partition":
    fastreduce.Partition().create_cartesian_topology_partition([WORLD.size])
elif where == "local-rank":
    fastreduce.local_rank()
elif where == "horovod":
    hvd.allreduce(torch.ones(4), name="late")
elif where == "torch-group":
    dist.all_reduce(torch.ones(1000))
elif where == "torch-group-async":
    gather_async()
print("not reached in the test: every rank finished", flush=True)
