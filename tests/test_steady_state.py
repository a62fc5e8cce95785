"""No allocations per in-place call, only the result out of place; GIL released in MPI."""

from mpirun import run_workers


def test_allocations_and_gil():
    out = run_workers("steady_state.py", 2)
    assert "on 2 ranks, 0 failed" in out


def test_result_cache():
    out = run_workers("result_cache.py", 2)
    assert "on 2 ranks, 0 failed" in out
