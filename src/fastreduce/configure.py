"""Hands the settings down to the compiled core, once, when fastreduce is imported.

The compiled modules never read the environment or import the Python core: the values read
at import are parsed here (an invalid one raises now, as it always has), and the ones read
at first use get a callable that reads them then (so their errors keep that timing).
"""

from __future__ import annotations

from . import algorithms, settings
from .backend import algochoice, buffer, cudart, engine, reduce, reductions
from .gpupaths import agreement as gpu_path_agreement


def hand_down_settings() -> None:
    """Give the compiled core the FASTREDUCE_* settings and the GPU path agreement."""
    # read at import
    segment = settings.value("FASTREDUCE_SEGMENT_BYTES")
    if segment is not None:  # else each communicator's plan decides
        reduce.set_segment_bytes(segment)
    megabytes = settings.value("FASTREDUCE_RESULT_CACHE_MB")
    if megabytes is not None:
        buffer.set_result_cache_limit(int(megabytes * (1 << 20)))
    kib = settings.value("FASTREDUCE_STAGING_CHUNK_KB")
    if kib is not None:
        cudart.set_staging_chunk(kib * 1024)
    reductions.set_half_ops(settings.value("FASTREDUCE_HALF_OPS"))
    # read at first use
    engine.set_setting_source(settings.value)  # FASTREDUCE_ENGINE(_HOST_BYTES)
    cudart.set_library_source(lambda: settings.value("FASTREDUCE_CUDART"))
    gpu_path_agreement.install()  # rank agreement on the GPU path settings
    algochoice.set_agreement(algorithms.agree)  # ... on the all-reduce algorithm

