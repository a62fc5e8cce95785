"""The environments a multi-rank session can run in, by name (`--profile NAME`).

What must be in place before fastreduce is imported (a fake CUDA runtime, a fake MPI layer,
a setting fastreduce reads once) is a profile: a case that needs it runs in a session
started with it. A case names its profile with `@pytest.mark.mpi(profile=...)`;
tests/support/sessions.py starts every (ranks, profile) session that some case asks for.
"""

from __future__ import annotations

# Settings a session never inherits from the caller's shell: a profile sets what it needs.
CLEARED = ("FASTREDUCE_CUDART", "FASTREDUCE_CUDA_AWARE", "FASTREDUCE_STAGING_CHUNK_KB",
           "FASTREDUCE_GPU_PATH", "FASTREDUCE_GPU_THRESHOLDS", "FASTREDUCE_GPU_THRESHOLDS_FILE",
           "FASTREDUCE_DEVICE_POINTERS", "FASTREDUCE_DEBUG", "FASTREDUCE_ENGINE",
           "FASTREDUCE_ENGINE_HOST_BYTES", "FASTREDUCE_TIMEOUT", "FASTREDUCE_HALF_OPS")


def _fake_cuda() -> dict[str, str]:
    import fakecuda

    return {"FASTREDUCE_CUDART": fakecuda.library_path()}


def _pointer_log() -> None:
    """The fake MPI layer's pointer log (tests/support/fakempi), which records the kind of
    memory every all-reduce is handed: it must be loaded before fastreduce is imported,
    which no case can do. It passes every call on to the real MPI."""
    import fakempi

    fakempi.install()


# name -> (what it is for, a function giving the variables it sets, what the session loads
# before fastreduce or None). Settings fastreduce reads at each call (the progress engine's,
# debug mode) are not profiles: a fixture sets them for its cases (engine.set_enabled,
# engine.set_host, fastreduce.set_debug) in the session their other needs choose.
PROFILES = {
    "default": ("no fastreduce setting", dict, None),
    "fakecuda": ("the GPU paths over the fake CUDA runtime (tests/support/fakecuda), MPI "
                 "calls logged by the kind of memory they are handed (tests/support/fakempi)",
                 _fake_cuda, _pointer_log),
    "half-ops-fastreduce": ("fastreduce's own 16-bit float ops",
                            lambda: {"FASTREDUCE_HALF_OPS": "fastreduce"}, None),
    "half-ops-mpi": ("the MPI's 16-bit float types where it has them",
                     lambda: {"FASTREDUCE_HALF_OPS": "mpi"}, None),
}


def environment(name: str) -> dict[str, str]:
    """The variables profile `name` sets; KeyError naming the known profiles otherwise."""
    if name not in PROFILES:
        raise KeyError(f"unknown test profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name][1]()


def prepare(name: str) -> None:
    """Load what profile `name` needs loaded before fastreduce (a session's start only)."""
    environment(name)
    if PROFILES[name][2] is not None:
        PROFILES[name][2]()
