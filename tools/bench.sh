#!/usr/bin/env bash
# Install everything (Open MPI wheel, mpi4py, torch, fastreduce: tools/bootstrap.sh) and
# run the all-reduce benchmark on this machine: fastreduce-bench, 4 B to 64 MiB, beside
# its peers (mpi4py, torch.distributed on gloo), with a plot. Extra arguments go to the
# benchmark (e.g. -e 1M; `--help` lists them). Ranks: NP (default 4); MPI: FASTREDUCE_MPI
# (openmpi or mpich). The table is printed; JSON and PNG land in bench/results/.
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
out="$root/bench/results/allreduce-$mpi-np$np"
"${launcher[@]}" "$venv/bin/python" -m fastreduce.bench -b 4 -e 64M -f 4 \
  --peers mpi4py,torch --json "$out.json" --plot "$out.png" "$@"
echo "table above; $out.json and $out.png written"
