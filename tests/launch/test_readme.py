"""The README's Python snippets run as written, on 2 MPI ranks; its links point at files."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

pytestmark = pytest.mark.one_mpi  # its subject does not depend on the MPI family

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# A ```python block; `<!-- skip-test ... -->` on the line before it keeps it out of the run.
BLOCK = re.compile(r"(?P<skip><!--\s*skip-test\b[^>]*-->\n)?```python\n(?P<code>.*?)^```",
                   re.S | re.M)


def snippets() -> list[tuple[int, str, bool]]:
    """(line number, code, skipped) of every Python block in the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start("code")) + 1, m["code"], bool(m["skip"]))
            for m in BLOCK.finditer(text)]


def test_readme_is_short_and_states_the_test_command():
    lines = README.read_text().splitlines()
    assert len(lines) < 250
    assert any("bash tools/test.sh" in line for line in lines)


def test_first_snippet_is_tested():
    assert snippets() and not snippets()[0][2]


def test_links_point_at_files():
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing


@pytest.mark.parametrize("line, code, skipped",
                         [pytest.param(*s, id=f"line{s[0]}") for s in snippets()])
def test_snippet_runs(line, code, skipped, tmp_path):
    if skipped:
        pytest.skip(f"README.md:{line} is marked skip-test")
    if re.search(r"^\s*(import torch|from torch)\b", code, re.M):
        pytest.importorskip("torch")
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text(code)
    # python -m mpi4py: an exception on one rank aborts the job instead of hanging it
    rc, output = run_mpi(2, sys.executable, "-m", "mpi4py", str(script), timeout=120)
    assert rc == 0, f"README.md:{line} failed on 2 ranks:\n{output}"
