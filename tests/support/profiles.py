"""The environments a multi-rank session can run in, by name (`--profile NAME`).

fastreduce reads its settings from the environment once, at first use, so a case that
needs another setting than the default runs in a session started with it. A case names
its profile with `@pytest.mark.mpi(profile=...)`; tests/support/sessions.py starts every
(ranks, profile) session that some case asks for.
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


def _pointer_log() -> dict[str, str]:
    """The fake CUDA runtime, with the fake MPI layer's pointer log loaded now: it must be
    loaded before fastreduce is imported, which no case can do (tests/support/fakempi)."""
    import fakempi

    fakempi.install()
    return _fake_cuda()


# name -> (what it is for, a function giving the variables it sets)
PROFILES = {
    "default": ("no fastreduce setting", dict),
    "fakecuda": ("the GPU paths over the fake CUDA runtime (tests/support/fakecuda)",
                 _fake_cuda),
    "fakecuda-engine-off": ("the GPU paths without the progress engine",
                            lambda: {**_fake_cuda(), "FASTREDUCE_ENGINE": "0"}),
    "debug": ("debug mode: every call's arguments compared across ranks",
              lambda: {"FASTREDUCE_DEBUG": "1"}),
    "engine-off": ("non-blocking calls on MPI's non-blocking collectives",
                   lambda: {"FASTREDUCE_ENGINE": "0"}),
    "engine-every-size": ("every non-blocking host call through the progress engine",
                          lambda: {"FASTREDUCE_ENGINE_HOST_BYTES": "0"}),
    "engine-host-off": ("no non-blocking host call through the progress engine",
                        lambda: {"FASTREDUCE_ENGINE_HOST_BYTES": "off"}),
    "half-ops-fastreduce": ("fastreduce's own 16-bit float ops",
                            lambda: {"FASTREDUCE_HALF_OPS": "fastreduce"}),
    "half-ops-mpi": ("the MPI's 16-bit float types where it has them",
                     lambda: {"FASTREDUCE_HALF_OPS": "mpi"}),
    "fakecuda-pointerlog": ("the fake CUDA runtime, MPI calls logged by the kind of memory "
                            "they are handed (tests/support/fakempi)", _pointer_log),
}


def environment(name: str) -> dict[str, str]:
    """The variables profile `name` sets; KeyError naming the known profiles otherwise."""
    if name not in PROFILES:
        raise KeyError(f"unknown test profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name][1]()
