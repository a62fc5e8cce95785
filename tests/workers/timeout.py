"""FASTREDUCE_TIMEOUT: a rank that never arrives; the others' watchdog prints the flight
record and aborts the job. argv[1]: how long the late rank sleeps."""

import sys
import time

import torch
from common import WORLD

import fastreduce

assert fastreduce.watchdog.timeout() is not None, "FASTREDUCE_TIMEOUT is not set"
x = torch.ones(4)
fastreduce.allreduce_(x)          # a few collectives that complete, for the record
fastreduce.allreduce(x, "max")
if WORLD.rank == 1:
    time.sleep(float(sys.argv[1]))  # late: the others wait in the next all-reduce
fastreduce.allreduce_(torch.ones(1000))
print("not reached in the test: every rank finished", flush=True)
