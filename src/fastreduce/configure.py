"""Checks every setting and hands the settings down to the compiled core, once, when
fastreduce is imported.

Every FASTREDUCE_* variable is parsed at import, those acted on later too (the GPU
settings on a machine with no GPU as well: checked, not acted on), so a bad value is named
before any call; a variable that looks like a misspelt setting is warned about. The
compiled modules never read the environment or import the Python core: the values read at
import are handed down here, and the ones read at first use get a callable that reads them
then.
"""

from __future__ import annotations

import warnings

from . import algorithms, settings
from .backend import algochoice, buffer, cudart, engine, reduce, reductions
from .errors import SettingError, SettingWarning
from .gpupaths import agreement as gpu_path_agreement
from .gpupaths import capabilities, modes


def check_settings() -> None:
    """Parse every setting in the environment: one SettingError naming each bad variable,
    its value and what to give; a SettingWarning for each likely misspelling."""
    for name, closest in settings.misspelled():
        warnings.warn(f"fastreduce: {name} is not a fastreduce setting and is ignored; did "
                      f"you mean {closest}?", SettingWarning, stacklevel=4)
    problems = []
    try:
        settings.check_all()
    except SettingError as exc:
        problems.append(str(exc).removeprefix("fastreduce: "))
    # the settings whose text is a table or a list, parsed by their owners
    for check in (algorithms.pinned_table, modes.pinned_thresholds, capabilities.declared_calls):
        try:
            check()
        except SettingError:
            pass  # a bad value of the variable itself: reported above
        except ValueError as exc:
            problems.append(str(exc).removeprefix("fastreduce: "))
    if problems:
        raise SettingError("fastreduce: " + "; ".join(problems))


def hand_down_settings() -> None:
    """Check every setting, then give the compiled core the FASTREDUCE_* settings and the
    GPU path agreement."""
    check_settings()
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

