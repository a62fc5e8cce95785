#!/bin/bash
# Build fastreduce for $PY against the system MPI (mpicc on PATH), from the wheels beside
# this script; prints the PYTHONPATH to use. Usage: build.sh PY MPI4PY_WHEEL
set -e
PY=$1; M4=$2
K=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$K/.." && pwd)
W=/tmp/gk; S=$W/site; B=$W/bin; rm -rf $W; mkdir -p $S $B
for w in "$K"/wheels/*.whl; do
  case $w in *mpi4py*) continue;; esac
  $PY -m zipfile -e "$w" $S
done
$PY -m zipfile -e "$M4" $S
cp $S/ninja-*.data/scripts/ninja $B/ninja; chmod +x $B/ninja
printf '#!/bin/sh\nexec %s -c "import sys; from Cython.Compiler.Main import setuptools_main; sys.exit(setuptools_main())" "$@"\n' "$PY" > $B/cython
printf '#!/bin/sh\nexec %s -m mesonbuild.mesonmain "$@"\n' "$PY" > $B/meson
chmod +x $B/cython $B/meson
export PATH=$B:$PATH PYTHONPATH=$S
cd "$ROOT"
meson setup $W/build --prefix=$W/inst -Dpython.platlibdir=$W/inst -Dpython.purelibdir=$W/inst >$W/setup.log 2>&1 || { tail -40 $W/setup.log; exit 1; }
ninja -C $W/build -j16 >$W/build.log 2>&1 || { tail -60 $W/build.log; exit 1; }
meson install -C $W/build >$W/install.log 2>&1 || { tail -40 $W/install.log; exit 1; }
echo "PYTHONPATH=$W/inst:$S"
