"""Which torch releases the torch.distributed backend runs on (a pure decision; importing
it needs no torch)."""

from __future__ import annotations

# The floor pyproject.toml declares for the torch extra. The backend's cases pass on 2.4,
# 2.6, 2.9, 2.10, 2.12, 2.13 and 2.15 (docs/install.md); what differs before 2.13 (no
# asyncOp in the options, the group's name, PREMUL_SUM's factor, C++ waiting on work) is
# handled where it is met.
FLOOR = (2, 4)
# From this release torch's C++ waits on a Python Work through Python (below it, through
# its own Work::wait, which a Python Work never reaches).
PYTHON_WORK_WAITED = (2, 13)


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.13.0+cpu" -> (2, 13))."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _torch_refusal(release: tuple[int, int]) -> str | None:
    """Why the backend refuses torch `release` (major, minor), or None where it runs."""
    if release >= FLOOR:
        return None
    return "the backend needs torch 2.4 or newer: pip install 'torch>=2.4'"


def _work_needs_cpp_wrapper(release: tuple[int, int]) -> bool:
    """Whether a collective's work must reach torch as a C++ work made from its future."""
    return release < PYTHON_WORK_WAITED
