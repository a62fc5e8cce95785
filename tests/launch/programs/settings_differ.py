"""Settings that choose a rank's MPI calls, different on different ranks: every rank raises
SettingError naming the setting and each rank's value, before any data moves; once the
ranks agree again, the same call works. Launched (a job of its own): before the ranks
agreed on these settings, such a difference corrupted the heap or hung.

Rank 0 and the others differ in FASTREDUCE_SEGMENT_BYTES, given in the environment before
the import (argv[1] "debug": with FASTREDUCE_DEBUG=1 too), then, one at a time, in the
progress engine (FASTREDUCE_ENGINE), its host threshold, the 16-bit ops and the GPU staging
chunk. Each rank prints "rank N: ok" when every case behaved, else what did not."""

import os
import sys

from mpi4py import MPI

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
os.environ["FASTREDUCE_SEGMENT_BYTES"] = "1M" if RANK == 0 else "3M"
if sys.argv[1:] == ["debug"]:
    os.environ["FASTREDUCE_DEBUG"] = "1"

import numpy as np  # noqa: E402

import fastreduce  # noqa: E402
from fastreduce import runtime  # noqa: E402
from fastreduce.backend import cudart, engine, reductions  # noqa: E402
from fastreduce.errors import SettingError  # noqa: E402

failures = []


def expect_refusal(case: str, call, x: np.ndarray, words: list[str]) -> None:
    """call() raises SettingError naming `words`, and x is as it was."""
    before = x.copy()
    try:
        call()
    except SettingError as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            failures.append(f"{case}: the error does not name {missing}: {exc}")
        elif not np.array_equal(x, before):
            failures.append(f"{case}: the data changed before the refusal")
        return
    failures.append(f"{case}: no SettingError")


def expect_sum(case: str, call, x: np.ndarray) -> None:
    """Once the ranks agree: call() reduces x."""
    x[:] = 1
    call()
    if not np.all(x == SIZE):
        failures.append(f"{case}: after the ranks agreed again, the sum is wrong")


x = np.ones(4 << 20, np.float32)  # 16 MiB: segments of 1 MiB on one rank, 3 MiB on another
others = "ranks 1" if SIZE > 2 else "rank 1"
expect_refusal("segments", lambda: fastreduce.allreduce_(x), x,
               ["FASTREDUCE_SEGMENT_BYTES", "rank 0 '1MiB'", f"{others}", "'3MiB'"])
runtime.set_segment_bytes(None)  # every rank: each communicator's plan decides again
expect_sum("segments", lambda: fastreduce.allreduce_(x), x)

y = np.ones(1 << 20, np.float32)  # past the engine's host threshold
if engine.state()[0]:  # with MPI_THREAD_MULTIPLE: one rank's engine off
    engine.set_enabled(RANK != 0)
    expect_refusal("engine", lambda: fastreduce.iallreduce_(y).wait(), y,
                   ["FASTREDUCE_ENGINE", "rank 0 'off'", "'on'"])
    expect_refusal("engine, broadcast", lambda: fastreduce.ibroadcast_(y).wait(), y,
                   ["FASTREDUCE_ENGINE"])
    engine.set_enabled(None)
    expect_sum("engine", lambda: fastreduce.iallreduce_(y).wait(), y)

    engine.set_host(False if RANK == 0 else True)
    expect_refusal("engine host bytes", lambda: fastreduce.iallreduce_(y).wait(), y,
                   ["FASTREDUCE_ENGINE_HOST_BYTES", "rank 0 'off'"])
    engine.set_host(None)
    expect_sum("engine host bytes", lambda: fastreduce.iallreduce_(y).wait(), y)
else:
    failures.append("the progress engine is off: the engine cases did not run")

if fastreduce.build_mpi()[0] != "MPICH":  # asking MPICH 5 about its 16-bit types aborts
    reductions.set_half_ops("mpi" if RANK == 0 else "fastreduce")
    expect_refusal("half ops", lambda: fastreduce.allreduce_(y), y,
                   ["FASTREDUCE_HALF_OPS", "rank 0 'mpi'", "'fastreduce'"])
    reductions.set_half_ops("auto")
    expect_sum("half ops", lambda: fastreduce.allreduce_(y), y)

cudart.set_staging_chunk(64 << 10 if RANK == 0 else 0)
expect_refusal("staging chunk", lambda: fastreduce.allgather(y), y,
               ["FASTREDUCE_STAGING_CHUNK_KB", "rank 0 '64KiB'", "'automatic'"])
cudart.set_staging_chunk(0)
expect_sum("staging chunk", lambda: fastreduce.allreduce_(y), y)

for text in failures:
    print(f"rank {RANK}: FAILED {text}", flush=True)
print(f"rank {RANK}: {'ok' if not failures else 'failed'}", flush=True)
