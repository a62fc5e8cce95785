"""fastreduce.horovod at the end of a program: a rank that exits shuts Horovod down, and the
ranks still submitting collectives learn it (they raise) instead of waiting forever."""

from mpirun import run_program


def test_the_others_learn_that_a_rank_has_ended():
    out = run_program("horovod_exit.py", 3, timeout=120)
    for r in (1, 2):
        for name in ("late", "later"):
            assert f"rank {r}, {name}: fastreduce.horovod: rank 0 of a process set of 3 shut " \
                   f"down" in out, out
