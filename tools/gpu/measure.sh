#!/bin/bash
# On the GPU machine (from tools/gpu/make_kit.sh): build fastreduce for the torch venv there,
# then measure and check every collective on CUDA tensors, ranks sharing the GPU under MPS;
# results and JSON into $OUT/logs.tar.gz, a summary on stdout. Usage: measure.sh [PART ...], parts
# (default: all but chunks, about 4 minutes on an H200):
#   movement    bench/gpu_movement_bench.py (the staged path against the same steps by hand)
#               at 2 and 4 ranks, and tests/mpi/test_gpu.py's movement cases at 2 and 4
#   horovod     Horovod's calls on CUDA tensors against fastreduce's, 2 ranks
#   collectives fastreduce-bench -c COLLECTIVE --device cuda for each, 2 ranks, 4 B to 64 MiB
#   tests       the whole of tests/mpi/test_gpu.py at 2 ranks
#   chunks      gpu_movement_bench.py with fastreduce's chunk plan and staged whole, 2 and 4
cd "$(dirname "$0")/.."
PY=/opt/torch/.venv/bin/python
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export PYTHONUNBUFFERED=1
parts=${*:-movement horovod collectives tests}
t0=$(date +%s)
.venv-gpukit/build.sh $PY .venv-gpukit/wheels/mpi4py-*cp312*.whl > $OUT/build.txt 2>&1 ||
  { tail -20 $OUT/build.txt; exit 1; }
export $(tail -1 $OUT/build.txt)
echo "built in $(( $(date +%s) - t0 )) s"
extra=; mpiexec --version | grep -q -E "Open MPI|OpenRTE" && extra=--oversubscribe
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
$PY -c "import fastreduce, torch; print(fastreduce.build_mpi(), fastreduce.cuda_aware(), torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() {  # step NAME TIMEOUT COMMAND...: its output into $OUT/NAME.txt, rc and time here
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name: rc=$? in $(( $(date +%s) - t )) s"
}
table() { grep -a -E "^\||worst|^#|^ +[0-9]+ " "$OUT/$1.txt"; }
pytest_tail() { tail -3 "$OUT/$1.txt" | sed 's/\x1b\[[0-9;]*m//g'; }
for part in $parts; do case $part in
movement)
  step movement2 150 mpiexec $extra -n 2 $PY bench/gpu_movement_bench.py --json $OUT/movement2.json
  table movement2
  step tests2 150 mpiexec $extra -n 2 $PY -m pytest tests/mpi/test_gpu.py -k "movement or cuda_runtime" -p no:cacheprovider -q -rs
  pytest_tail tests2
  step movement4 150 mpiexec $extra -n 4 $PY bench/gpu_movement_bench.py --sizes 1M,16M,64M --json $OUT/movement4.json
  table movement4
  step tests4 120 mpiexec $extra -n 4 $PY -m pytest tests/mpi/test_gpu.py -k "movement" -p no:cacheprovider -q -rs
  pytest_tail tests4;;
horovod)
  step horovod2 100 mpiexec $extra -n 2 $PY bench/horovod_movement_bench.py --device cuda --repeat 3
  table horovod2;;
collectives)
  for c in broadcast reduce allgather reduce_scatter alltoall gather scatter; do
    step "bench-$c" 60 mpiexec $extra -n 2 $PY -m fastreduce.bench -c $c --device cuda --gpu-paths auto,staged -b 4 -e 64M -f 16
    grep -a -E "Out of bounds|Avg bus" "$OUT/bench-$c.txt"
  done
  step gpubench 200 $PY -m pytest tests/launch/test_gpu_bench.py -k every_collective -p no:cacheprovider -q -rs
  pytest_tail gpubench;;
tests)
  step alltests2 170 mpiexec $extra -n 2 $PY -m pytest tests/mpi/test_gpu.py -p no:cacheprovider -q -rs
  pytest_tail alltests2;;
chunks)
  for n in 2 4; do
    for chunk in 0 1G; do
      step "chunks$n-$chunk" 100 mpiexec $extra -n $n $PY bench/gpu_movement_bench.py --sizes 1M,4M,16M --repeat 5 --staging-chunk $chunk --json $OUT/chunks$n-$chunk.json
      table "chunks$n-$chunk"
    done
  done;;
*) echo "measure.sh: no part $part"; exit 2;;
esac; done
echo quit | nvidia-cuda-mps-control 2>/dev/null
# every log in one file (what comes back from $OUT is limited in files, not in bytes)
(cd $OUT && tar czf logs.tar.gz --remove-files *.txt *.json 2>/dev/null)
echo "total $(( $(date +%s) - t0 )) s"
