"""fastreduce.horovod at the end of a program: a rank that exits shuts Horovod down, and the
ranks still submitting collectives learn it (they raise) instead of waiting forever; a rank
that ends on an uncaught exception ends the job."""

import sys
import time

from mpirun import PROGRAMS, run_mpi, run_program


def test_the_others_learn_that_a_rank_has_ended():
    out = run_program("horovod_exit.py", 3, timeout=120)
    for r in (1, 2):
        for name in ("late", "later"):
            assert f"rank {r}, {name}: fastreduce.horovod: rank 0 of a process set of 3 shut " \
                   f"down" in out, out


def test_an_uncaught_exception_ends_the_job():
    """Without `python -m mpi4py`: rank 1 raises while rank 0 waits in hvd.barrier()."""
    start = time.monotonic()
    rc, out = run_mpi(2, sys.executable, str(PROGRAMS / "horovod_crash.py"), timeout=90)
    assert rc != 0 and time.monotonic() - start < 60, (rc, out)
    assert "rank 1 fails here" in out and "not reached" not in out, out
