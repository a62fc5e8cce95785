"""Settings under misuse: a bad value is named at import, a misspelt name is warned about,
and settings that differ between ranks end in SettingError on every rank (launched jobs:
before the ranks agreed on them, such differences corrupted the heap or hung)."""

import os
import subprocess
import sys

import pytest
from mpirun import PROGRAMS, run_mpi


@pytest.mark.parametrize(("nprocs", "mode"), [(2, ""), (3, "debug")], ids=["2", "3-debug"])
def test_settings_that_differ_between_ranks(nprocs, mode):
    """FASTREDUCE_SEGMENT_BYTES 1M on rank 0 and 3M on the others (with debug mode too),
    then the engine, its threshold, 16-bit ops and staging chunk: every rank
    raises SettingError naming the setting and the ranks' values, data untouched; once
    they agree, the call works."""
    rc, out = run_mpi(nprocs, sys.executable, str(PROGRAMS / "settings_differ.py"),
                      *([mode] if mode else []), timeout=120)
    assert rc == 0, out
    for rank in range(nprocs):
        assert f"rank {rank}: ok" in out, out
    assert "FAILED" not in out, out


def _import(env: dict) -> subprocess.CompletedProcess:
    """`import fastreduce` in a fresh process (a singleton MPI job) with env added."""
    return subprocess.run([sys.executable, "-c", "import fastreduce"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


@pytest.mark.one_mpi
@pytest.mark.parametrize(("variable", "value", "words"), [
    ("FASTREDUCE_RESULT_CACHE_MB", "-1", "from 0 to"),
    ("FASTREDUCE_RESULT_CACHE_MB", "nan", "from 0 to"),
    ("FASTREDUCE_SEGMENT_BYTES", "99999999999999G", "at most 1024TiB"),
    ("FASTREDUCE_STAGING_CHUNK_KB", "-3", "(0: automatic)"),
    ("FASTREDUCE_ENGINE", "2", "use 0 or 1"),
    ("FASTREDUCE_TIMEOUT", "inf", "give seconds"),
    ("FASTREDUCE_GPU_THRESHOLDS", "0:fast", "FASTREDUCE_GPU_THRESHOLDS"),
    ("FASTREDUCE_DEVICE_POINTERS", "sometimes", "give 'none' or"),
    ("FASTREDUCE_ALGORITHM_TABLE", "0:ring,1K", "FASTREDUCE_ALGORITHM_TABLE"),
])
def test_a_bad_setting_is_named_at_import(variable, value, words):
    """A bad value (negative, NaN, past int64, out of its choices, a bad table, GPU
    settings on a machine with no GPU too) fails the import with SettingError naming the
    variable, its value and what to give; no bare OverflowError or ValueError."""
    done = _import({variable: value})
    assert done.returncode != 0
    assert "fastreduce.errors.SettingError" in done.stderr, done.stderr
    assert variable in done.stderr and words in done.stderr, done.stderr
    assert "OverflowError" not in done.stderr, done.stderr


@pytest.mark.one_mpi
def test_a_misspelt_setting_is_warned_about():
    """FASTREDUCE_TIMEOUTS (for FASTREDUCE_TIMEOUT): a warning naming the setting meant;
    the test suite's own FASTREDUCE_TEST_* variables are no settings and pass silently."""
    done = _import({"FASTREDUCE_TIMEOUTS": "5", "FASTREDUCE_TEST_SOMETHING": "1"})
    assert done.returncode == 0, done.stderr
    assert "SettingWarning" in done.stderr and "FASTREDUCE_TIMEOUTS" in done.stderr, \
        done.stderr
    assert "did you mean FASTREDUCE_TIMEOUT?" in done.stderr, done.stderr
    assert "FASTREDUCE_TEST_SOMETHING" not in done.stderr, done.stderr
