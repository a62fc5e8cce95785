"""The sources pass the linters the project names: ruff for Python, cython-lint for the
Cython core (tools/bootstrap.sh installs both)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    exe = BIN / tool
    if not exe.exists():
        pytest.skip(f"{tool} is not installed beside {sys.executable} (tools/bootstrap.sh "
                    f"installs it)")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


def test_ruff():
    proc = _run("ruff", "check", "src", "tests", "bench", "examples", "tools", "docs")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cython_lint():
    sources = sorted(str(p.relative_to(ROOT)) for pattern in ("*.pyx", "*.pxd", "*.pxi")
                     for p in (ROOT / "src").rglob(pattern))
    assert sources, "no Cython sources found under src/"
    proc = _run("cython-lint", *sources)
    assert proc.returncode == 0, proc.stdout + proc.stderr
