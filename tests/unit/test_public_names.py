"""The public names of the modules in torch/ and tools/ (fastreduce/__init__.py's table):
each import form gives the real module itself, submodules included, and `python -m` runs
the tools. One process each (importing fastreduce initialises MPI: a singleton here)."""

import subprocess
import sys

from mpirun import launcher_env
from test_import_layering import public_modules

CHECK = """
import importlib, sys
import fastreduce
table = fastreduce._PUBLIC_MODULES
assert table == {table!r}, "the table the layering test read is not the one imported"
for public, real in table.items():
    if public in ("distributed", "horovod", "distdl", "nn", "autograd", "gradsync", "ops"):
        try:
            import torch  # noqa: F401
        except ImportError:
            continue
    module = importlib.import_module(f"fastreduce.{public}")
    assert module is importlib.import_module(f"fastreduce.{real}"), public
    assert module is getattr(fastreduce, public) and module.__name__ == f"fastreduce.{real}"
    assert module.__spec__.name == f"fastreduce.{real}", (public, module.__spec__)
    assert sys.modules[f"fastreduce.{public}"] is module
exec("from fastreduce import nn as a; import fastreduce.torch.nn as b; assert a is b")
import fastreduce.horovod.basics
assert fastreduce.horovod.basics is sys.modules["fastreduce.torch.horovod.basics"]
try:
    import fastreduce.no_such_name
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("fastreduce.no_such_name imported")
print("ok")
"""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=launcher_env(), timeout=300)


def test_every_import_form_gives_the_real_module():
    proc = run("-c", CHECK.replace("{table!r}", repr(public_modules())))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


def test_python_m_runs_the_tools():
    """`python -m fastreduce.bench` runs tools/benchmark/__main__.py, whose relative
    imports give the modules already loaded (no second copy under the public name)."""
    code = ("import runpy, sys; sys.argv = ['fastreduce.bench', '--help']\n"
            "try:\n    runpy.run_module('fastreduce.bench', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "copies = [n for n, m in sys.modules.items() if n.startswith('fastreduce.bench.')\n"
            "          and m is not sys.modules[n.replace('bench', 'tools.benchmark', 1)]]\n"
            "assert not copies, copies\n"
            "print('ok')")
    proc = run("-c", code)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
    for tool in ("bench", "cluster"):
        proc = run("-m", f"fastreduce.{tool}", "--help")
        assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stdout + proc.stderr


def test_gpu_path_names_moved_out_of_runtime_say_where():
    code = ("import fastreduce.runtime as r\n"
            "try:\n    r.set_gpu_path\nexcept AttributeError as exc:\n    print(exc)\n")
    done = run("-c", code)
    assert done.returncode == 0, done.stderr
    assert "fastreduce.gpupaths.set_gpu_path" in done.stdout, done.stdout
