"""A user's script that imports every public module (fastreduce.horovod, .nn, ...) passes
mypy and pyright (basedpyright: the pyright engine as PyPI ships it): each name resolves,
through its file beside __init__.py, to the real module's names; a name no module has is
reported (the checks can fail)."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mpirun import launcher_env

# One public name of each module, used as a user would.
SCRIPT = """
import fastreduce
import fastreduce.autograd
import fastreduce.distributed
import fastreduce.horovod as hvd
import fastreduce.nn
from fastreduce import bench, cluster, distdl, gradsync, info, ops

hvd.init()
size: int = hvd.size()
opt = hvd.DistributedOptimizer
layer = fastreduce.nn.AllSumReduce
reduce = fastreduce.autograd.all_sum_reduce
group = fastreduce.distributed.ProcessGroupFastreduce
partition = distdl.MPICartesianPartition
sync = gradsync.GradientSync
op = ops.allreduce_
parser = bench.build_parser()
node = cluster.Node
facts = info.collect
"""

# The same script with a name no public module has: mypy must say so (the check can fail).
WRONG = SCRIPT + "missing = hvd.no_such_name\n"

# torch's own sources are long to check and not the subject: its names are taken as Any;
# fastreduce's modules are read (to resolve names) without reporting their own findings.
CONFIG = """
[mypy]
follow_imports = silent
ignore_missing_imports = False
[mypy-torch.*,numpy.*,mpi4py.*,matplotlib.*]
follow_imports = skip
"""


def _mypy(tmp_path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
         str(tmp_path / "cache"), "--no-error-summary", str(script)],
        capture_output=True, text=True, env=launcher_env(), timeout=600, cwd=tmp_path)


def test_every_public_module_resolves_for_mypy(tmp_path):
    pytest.importorskip("mypy", reason="needs mypy (tools/bootstrap.sh installs it)")
    proc = _mypy(tmp_path, SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wrong = _mypy(tmp_path, WRONG)
    assert wrong.returncode == 1 and 'has no attribute "no_such_name"' in wrong.stdout, (
        wrong.stdout + wrong.stderr)


def _pyright(tmp_path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    # pyright's standard mode, as a user's editor runs it; the installed packages resolved
    # from this interpreter
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({"typeCheckingMode": "standard"}))
    pyright = shutil.which("basedpyright", path=str(Path(sys.executable).parent))
    return subprocess.run([pyright, "--pythonpath", sys.executable, str(script)],
                          capture_output=True, text=True, env=launcher_env(), timeout=600,
                          cwd=tmp_path)


def test_every_public_module_resolves_for_pyright(tmp_path):
    if shutil.which("basedpyright", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("needs basedpyright (tools/bootstrap.sh installs it)")
    proc = _pyright(tmp_path, SCRIPT)
    assert proc.returncode == 0 and "0 errors, 0 warnings" in proc.stdout, (
        proc.stdout + proc.stderr)
    wrong = _pyright(tmp_path, WRONG)
    assert wrong.returncode == 1 and '"no_such_name" is not a known attribute' in wrong.stdout, (
        wrong.stdout + wrong.stderr)
