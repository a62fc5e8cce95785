"""The progress engine at interpreter exit: requests started and never waited for are
delivered, and a request made after the engine stopped still works (over the fake CUDA
runtime). A launched program: what it checks happens when the interpreter exits."""

from mpirun import run_program


def test_requests_pending_at_exit_are_delivered(fake_cuda):
    out = run_program("engine_exit.py", 3, timeout=300)
    assert out.count("delivered at exit: True") == 3, out
    assert out.count("request after the engine stopped: True") == 3, out
