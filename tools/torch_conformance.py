"""Run PyTorch's own distributed tests against the fastreduce backend, and say what passes.

The tests are DistributedTest._DistTestBase from the installed torch
(torch/testing/_internal/distributed/distributed_test.py, shipped in the wheel; nothing is
copied or changed). A harness written into a scratch folder outside the repository runs
them as PyTorch's MPI mode did: one MPI job per rank count, every rank running every test
in the same order under pytest (tools/conformance_runner.py: a hung test costs one test,
each rank's outcome is kept). Each test gets a fresh default group
(init_process_group(BACKEND), rank and rendezvous from MPI, the suite's own per-test
timeout) and a barrier before and after. The backend is declared for the suite's feature
sets it supports (--features, default ddp,subgroup,plugin) and, with --profiling, as a
backend that records profiler events.

    python tools/torch_conformance.py --ranks 2,3
    python tools/torch_conformance.py --ranks 2 --backend gloo        # the same harness on gloo
    python tools/torch_conformance.py --ranks 2 -k "all_reduce or barrier" --timeout 60

The interpreter that runs this script is the one the ranks run (a venv with fastreduce
built, pytest-timeout and what torch's test modules import: pip install expecttest), with
the mpiexec beside it.
Prints the counts per rank count and each test that did not pass with the first line of
its error; --json writes every outcome.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from conformance_runner import PLUGIN, add_arguments, run_all

HARNESS = '''"""PyTorch's DistributedTest._DistTestBase on every rank, in lockstep."""
import os
from datetime import timedelta

import torch.testing._internal.common_distributed as common

BACKEND = os.environ["BACKEND"]
if BACKEND == "fastreduce":
    for feature in filter(None, os.environ["CONFORMANCE_FEATURES"].split(",")):
        common.DistTestCases.backend_feature[feature].add(BACKEND)

import fastreduce.distributed  # noqa: E402,F401  (registers the backend; MPI rendezvous)
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.testing._internal.common_utils import TestCase  # noqa: E402
from torch.testing._internal.distributed import distributed_test as suite  # noqa: E402

if BACKEND == "fastreduce" and os.environ.get("CONFORMANCE_PROFILING") == "1":
    for name in ("PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
        getattr(suite, name, []).append(BACKEND)


class TestLockstep(TestCase, suite.DistributedTest._DistTestBase):
    @property
    def world_size(self):
        return os.environ["WORLD_SIZE"]

    @property
    def init_method(self):
        return "file://" + self.file_name

    def setUp(self):
        super().setUp()
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.file_name = os.path.join(os.environ["TEMP_DIR"], "store-" + self._testMethodName)
        seconds = suite.CUSTOM_PG_TIMEOUT.get(self._testMethodName, suite.default_pg_timeout)
        dist.init_process_group(BACKEND, timeout=timedelta(seconds=seconds))
        self._barrier()

    def tearDown(self):
        if dist.is_initialized():
            self._barrier()
            dist.destroy_process_group()
        super().tearDown()

    def _barrier(self, *args, **kwargs):
        MPI.COMM_WORLD.Barrier()

    def _callTestMethod(self, method):  # noqa: N802
        # the suite's skips in a spawned process are exit codes the parent reads
        skips = {s.exit_code: s.message for s in common.TEST_SKIPS.values()}
        try:
            super()._callTestMethod(method)
        except SystemExit as exc:
            if exc.code in skips:
                self.skipTest(skips[exc.code])
            raise
'''
TESTS = "test_distributed_lockstep.py"


def scratch() -> Path:
    """A folder with the harness, the recording plugin and the suite's temporary folders."""
    root = Path(tempfile.mkdtemp(prefix="fastreduce-torch-suite-"))
    (root / TESTS).write_text(HARNESS)
    (root / "conftest.py").write_text(PLUGIN)
    for sub in ("barrier", "test_dir"):
        (root / "tmp" / sub).mkdir(parents=True)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="fastreduce", help="fastreduce (default) or gloo")
    parser.add_argument("--features", default="ddp,subgroup,plugin",
                        help="the suite's backend_feature sets to declare the backend in")
    parser.add_argument("--profiling", action="store_true",
                        help="declare the backend as one that records profiler events")
    add_arguments(parser)
    args = parser.parse_args(argv)
    root = scratch()

    def env_for(ranks: int) -> dict:
        return {"BACKEND": args.backend, "WORLD_SIZE": str(ranks),
                "TEMP_DIR": str(root / "tmp"), "CONFORMANCE_FEATURES": args.features,
                "CONFORMANCE_PROFILING": "1" if args.profiling else "0"}

    return run_all(root, TESTS, args, env_for,
                   hint="torch's test modules need expecttest: pip install expecttest")

if __name__ == "__main__":
    sys.exit(main())
