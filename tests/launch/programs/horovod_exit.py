"""A rank that ends its program while the others still submit collectives
(tests/launch/test_horovod_exit.py runs it on 3 ranks).

Rank 0 returns at once; at its exit fastreduce.horovod shuts down, as Horovod does. The other
ranks' next allreduce must raise HorovodInternalError naming rank 0 (not wait for it
forever), and a later collective must raise at once. Each prints what it learned.
"""

from __future__ import annotations

import torch

import fastreduce.horovod as hvd

hvd.init()
if hvd.rank() != 0:
    for name in ("late", "later"):
        try:
            hvd.allreduce(torch.ones(3), name=name)
        except hvd.HorovodInternalError as exc:
            print(f"rank {hvd.rank()}, {name}: {exc}", flush=True)
        else:
            print(f"rank {hvd.rank()}, {name}: no error", flush=True)
