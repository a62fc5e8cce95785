"""Run Horovod's own torch tests against fastreduce.horovod, and say what passes.

Given a Horovod checkout (its test/parallel/test_torch.py and test/utils/common.py; this
script fetches nothing), the tests run unchanged through an import shim (`horovod.torch`
is `fastreduce.horovod`) in a scratch folder outside the repository, as Horovod runs them:
one MPI job per rank count, every rank running the whole file in order under pytest
(tools/conformance_runner.py: a hung test costs one test; each rank's outcome is kept).

    python tools/horovod_conformance.py --horovod ~/src/horovod --ranks 2,3
    python tools/horovod_conformance.py --horovod DIR --ranks 2 -k join --timeout 60

The interpreter that runs this script is the one the ranks run (a venv with fastreduce
built, e.g. .venv-mpich/bin/python, and what Horovod's test helpers import: pip install
cloudpickle mock packaging), with the mpiexec beside it. Prints a table per rank
count (passed on every rank / failed / skipped / hung, and each test that did not pass
with the first line of its error) and writes everything as JSON with --json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from conformance_runner import PLUGIN, add_arguments, run_all

HINT = ("Horovod's test helpers need cloudpickle, mock and packaging: "
        "pip install cloudpickle mock packaging")

# The shim, written into the scratch folder.
SHIM = "import sys\nimport fastreduce.horovod\nsys.modules[__name__] = fastreduce.horovod\n"
# Horovod's test helpers import a thread starter from its launcher, which the torch tests
# do not use otherwise.
THREADS = """import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
"""
def scratch(horovod: Path) -> Path:
    """A folder with Horovod's test file and helpers, the shim and the recording plugin."""
    source = horovod / "test" / "parallel" / "test_torch.py"
    helpers = horovod / "test" / "utils" / "common.py"
    for path in (source, helpers):
        if not path.exists():
            sys.exit(f"horovod_conformance: {path} not found: give --horovod a Horovod "
                     f"checkout (git clone https://github.com/horovod/horovod)")
    root = Path(tempfile.mkdtemp(prefix="fastreduce-horovod-"))
    (root / "test" / "parallel").mkdir(parents=True)
    (root / "test" / "utils").mkdir()
    shutil.copy(source, root / "test" / "parallel" / "test_torch.py")
    shutil.copy(helpers, root / "test" / "utils" / "common.py")
    (root / "test" / "parallel" / "conftest.py").write_text(PLUGIN)
    (root / "shim" / "horovod" / "torch").mkdir(parents=True)
    (root / "shim" / "horovod" / "__init__.py").write_text("")
    (root / "shim" / "horovod" / "torch" / "__init__.py").write_text(SHIM)
    (root / "shim" / "horovod" / "runner" / "util").mkdir(parents=True)
    for package in ("runner", "runner/util"):
        (root / "shim" / "horovod" / package / "__init__.py").write_text("")
    (root / "shim" / "horovod" / "runner" / "util" / "threads.py").write_text(THREADS)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horovod", type=Path, required=True, help="a Horovod checkout")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_all(scratch(args.horovod.expanduser()), "test/parallel/test_torch.py", args,
                   hint=HINT)

if __name__ == "__main__":
    sys.exit(main())
