#!/bin/bash
# On the GPU machine (from tools/gpu/make_kit.sh): build fastreduce for the torch venv there,
# then measure and check every collective on CUDA tensors: bench/gpu_movement_bench.py (the
# staged path against the same steps by hand) at 2 and 4 ranks, Horovod's calls on CUDA
# tensors against fastreduce's (bench/horovod_movement_bench.py --device cuda),
# fastreduce-bench -c allgather --device cuda from 4 B, and tests/mpi/test_gpu.py's
# movement cases at 2 and 4 ranks; ranks share the GPU under MPS. Results and JSON into
# $OUT, a summary on stdout. About 6 minutes on an H200.
cd "$(dirname "$0")/.."
PY=/opt/torch/.venv/bin/python
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export PYTHONUNBUFFERED=1
t0=$(date +%s)
.venv-gpukit/build.sh $PY .venv-gpukit/wheels/mpi4py-*cp312*.whl > $OUT/build.txt 2>&1 ||
  { tail -20 $OUT/build.txt; exit 1; }
export $(tail -1 $OUT/build.txt)
echo "built in $(( $(date +%s) - t0 )) s"
extra=; mpiexec --version | grep -q -E "Open MPI|OpenRTE" && extra=--oversubscribe
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
$PY -c "import fastreduce, torch; print(fastreduce.build_mpi(), fastreduce.cuda_aware(), torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
step() {  # step NAME TIMEOUT COMMAND...: its output into $OUT/NAME.txt, rc and time here
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name: rc=$? in $(( $(date +%s) - t )) s"
}
step movement2 150 mpiexec $extra -n 2 $PY bench/gpu_movement_bench.py --json $OUT/movement2.json
grep -E "^\||worst" $OUT/movement2.txt
step tests2 150 mpiexec $extra -n 2 $PY -m pytest tests/mpi/test_gpu.py -k "movement or cuda_runtime" -p no:cacheprovider -q -rs
tail -3 $OUT/tests2.txt
step horovod2 100 mpiexec $extra -n 2 $PY bench/horovod_movement_bench.py --device cuda --repeat 3
grep -E "^\|" $OUT/horovod2.txt
step movement4 150 mpiexec $extra -n 4 $PY bench/gpu_movement_bench.py --sizes 1M,16M,64M --json $OUT/movement4.json
grep -E "^\||worst" $OUT/movement4.txt
step tests4 120 mpiexec $extra -n 4 $PY -m pytest tests/mpi/test_gpu.py -k "movement" -p no:cacheprovider -q -rs
tail -3 $OUT/tests4.txt
step allgather2 60 mpiexec $extra -n 2 $PY -m fastreduce.bench -c allgather --device cuda -b 4 -e 64M -f 8
tail -14 $OUT/allgather2.txt
if [ $(( $(date +%s) - t0 )) -lt 330 ]; then  # time left: the whole GPU file at 2 ranks
  step alltests2 170 mpiexec $extra -n 2 $PY -m pytest tests/mpi/test_gpu.py -p no:cacheprovider -q -rs
  tail -3 $OUT/alltests2.txt
fi
echo quit | nvidia-cuda-mps-control 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
