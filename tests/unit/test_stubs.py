"""The .pyi stubs of the extension modules match what the modules define (mypy stubtest)."""

import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import launcher_env

MODULES = [f"fastreduce.backend.{name}" for name in (
    "mpierrors", "commattr", "buffer", "reductions", "cudart", "pathchoice", "engine", "algochoice",
    "reduce", "staging", "collectives")]


def test_stubs_match_the_extension_modules():
    pytest.importorskip("mypy", reason="stubtest needs mypy (tools/bootstrap.sh installs it)")
    allowlist = Path(__file__).parent / "stubtest-allowlist.txt"
    proc = subprocess.run([sys.executable, "-m", "mypy.stubtest", *MODULES,
                           "--allowlist", str(allowlist)],
                          capture_output=True, text=True, env=launcher_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
